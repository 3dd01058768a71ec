"""The models a training run starts from: the frozen target (its weights as the engine loads
them) and the drafter, random or initialised from a source drafter whose vocabulary is mapped
onto the run's draft vocabulary."""

import json
import logging
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError

from speculative.drafter import Eagle3Drafter
from speculative.drafter_format import (
    drafter_config_for,
    drafter_state_dict,
    load_drafter,
    random_drafter_state,
    save_drafter,
)
from speculative.train.config import TrainConfig
from speculative.train.data import TokenStore, draft_vocab
from workers.layers.fp8 import cast_
from workers.layers.parallel import VocabParallelEmbedding
from workers.models import DecoderModel, ModelConfig, load_config, model_class
from workers.models.loader import load_target_weights, resolve_model

log = logging.getLogger(__name__)


def load_target(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    aux_layer_ids: tuple[int, ...] | None = None,
) -> DecoderModel:
    """The frozen target, capturing `aux_layer_ids` (those of the drafter it trains; None: the
    default)."""
    model_dir = resolve_model(model)
    target_cfg = ModelConfig.from_hf(load_config(model_dir))
    target = model_class(target_cfg)(target_cfg, aux_layer_ids=aux_layer_ids)
    load_target_weights(target, model_dir)
    cast_(target, device, dtype)  # an FP8 checkpoint's weights and scales as they are
    return target.eval()


def load_source(path: str, target_cfg: ModelConfig, target_embeddings=None) -> Eagle3Drafter:
    """The init_from drafter, or a ValueError that says why it cannot be trained further for this
    target. Without the target's embeddings (the check before distilling), a stand-in without
    storage."""
    if target_embeddings is None:
        with torch.device("meta"):
            target_embeddings = VocabParallelEmbedding(
                target_cfg.vocab_size, target_cfg.hidden_size
            )
    try:
        source = load_drafter(Path(path), target_embeddings=target_embeddings)
    except (OSError, KeyError, RuntimeError, ValueError, SafetensorError) as e:
        raise ValueError(f"init_from {path} is not a usable drafter: {e}") from e
    if source.cfg.norm_before_residual:  # the training forward (ttt.py) adds the raw hidden
        raise ValueError(f"init_from {path} sets norm_before_residual, which training does not run")
    # load_drafter checked the rest
    aux = source.cfg.aux_layer_ids or target_cfg.default_aux_layer_ids()
    if max(aux) >= target_cfg.num_hidden_layers:
        raise ValueError(
            f"init_from {path} reads aux layers {aux}; "
            f"the target has {target_cfg.num_hidden_layers}"
        )
    return source


def init_drafter(
    cfg: TrainConfig, target: DecoderModel, store: TokenStore, path: Path
) -> Eagle3Drafter:
    """The drafter to train, written to `path` (the checkpoint format) and loaded back. Its draft
    vocabulary is the responses' most frequent tokens; its LM head and final norm start from the
    target's rows for them (a warm start for the head). With `cfg.init_from`, every other weight
    comes from that drafter, and so do the head rows of the tokens both vocabularies hold; the
    other rows are the target's, mapped as the source's rows were."""
    eos = target.cfg.eos_token_id
    always = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
    d2t, t2d, coverage = draft_vocab(store, target.cfg.vocab_size, cfg.draft_vocab_size, always)
    draft_to_target = torch.arange(cfg.draft_vocab_size) + d2t
    head = target.lm_head.weight[draft_to_target.to(target.lm_head.weight.device)].float().cpu()
    if not cfg.init_from:
        dcfg = drafter_config_for(target.cfg, cfg.draft_vocab_size)
        state = random_drafter_state(dcfg, len(target.aux_layer_ids), cfg.seed)
        state["norm.weight"] = target.norm.weight.float().cpu()
    else:
        source = load_source(cfg.init_from, target.cfg, target.embed_tokens)
        if (source.cfg.aux_layer_ids or target.cfg.default_aux_layer_ids()) != target.aux_layer_ids:
            raise ValueError(
                f"init_from {cfg.init_from} reads aux layers {source.cfg.aux_layer_ids}, "
                "the target "
                f"captures {target.aux_layer_ids}: build it with load_target(..., aux_layer_ids)"
            )
        dcfg = replace(source.cfg, draft_vocab_size=cfg.draft_vocab_size)
        state = {
            n: t.float() if t.is_floating_point() else t
            for n, t in drafter_state_dict(source).items()
        }
        source_head = state.pop("lm_head.weight")
        source_ids = torch.arange(source.cfg.draft_vocab_size) + source.d2t.cpu()
        # The target's rows as they are start far from the trained ones (SmolLM2, 8192 -> 24576
        # tokens: depth-0 accuracy 0.21 against the source's 0.69); the affine map that best takes
        # the target's rows of the source's tokens to the source's rows brings them along (0.65;
        # BENCHMARKS.md, answered questions).
        if len(source_ids) < 2 * (source_head.shape[1] + 1):
            log.warning(
                "init_from %s has %d draft tokens, few for fitting the map of %d-wide head rows: "
                "the rows of new tokens may start poorly",
                cfg.init_from,
                len(source_ids),
                source_head.shape[1],
            )
        target_rows = (
            target.lm_head.weight[source_ids.to(target.lm_head.weight.device)].float().cpu()
        )
        head = (
            _append_ones(head) @ torch.linalg.lstsq(_append_ones(target_rows), source_head).solution
        )
        row = torch.full((target.cfg.vocab_size,), -1)
        row[draft_to_target] = torch.arange(cfg.draft_vocab_size)
        source_rows = row[source_ids]
        shared = source_rows >= 0
        head[source_rows[shared]] = source_head[shared]
        log.info(
            "from %s: %d of %d draft tokens keep its head rows",
            cfg.init_from,
            int(shared.sum()),
            cfg.draft_vocab_size,
        )
    state.update({"lm_head.weight": head, "d2t": d2t, "t2d": t2d})
    log.info(
        "draft vocabulary of %d tokens covers %.1f%% of response tokens",
        cfg.draft_vocab_size,
        100 * coverage,
    )
    save_drafter(path, dcfg, state)
    (path / "vocab_coverage.json").write_text(json.dumps({"coverage": coverage}))
    return load_drafter(path, target_embeddings=target.embed_tokens)


def _append_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, torch.ones(len(rows), 1)], dim=1)
