"""The EAGLE-3 drafter's checkpoint format (the one the EAGLE authors publish and vLLM, SGLang and
TensorRT-LLM load): reading, checking, writing, int8 storage, and the default drafters. vLLM's
speculators layout is read too (drafter_speculators.py).

Checkpoint tensors: midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
hidden_norm, post_attention_layernorm}.weight, fc.weight, norm.weight, lm_head.weight, d2t, t2d and
optionally embed_tokens.weight (shared with the target when absent). Target id = draft id + d2t[id].
A 2-D weight may also be stored as int8 with a float32 scale per output row, `<name>_scale`
(`drafter_int8.py`): half the bytes of bfloat16, dequantized on load. The other tools load the
bfloat16 form only.
"""

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from speculative.drafter import DrafterConfig, Eagle3Drafter
from speculative.drafter_int8 import dequantize_int8
from speculative.drafter_speculators import flat_config, is_speculators
from workers.layers.parallel import VocabParallelEmbedding
from workers.models.config import load_config
from workers.models.loader import cache_root, iter_safetensors, load_weights


def _standard_name(name: str) -> str:
    """Accept both the EAGLE authors' names and the `model.`-prefixed variant some tools write."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def read_drafter_config(path: Path) -> DrafterConfig:
    """The flat config of the EAGLE authors and SpecForge, or vLLM's speculators config."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"drafter directory {path} has no config.json")
    cfg = load_config(path)
    try:
        return DrafterConfig.from_hf(flat_config(cfg) if is_speculators(cfg) else cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ValueError(
            f"{Path(path) / 'config.json'}: not an EAGLE-3 drafter config ({type(e).__name__}: {e})"
        ) from None


def load_drafter(
    path: Path,
    group=None,
    target_embeddings: VocabParallelEmbedding | None = None,
    max_positions: int = 4096,
) -> Eagle3Drafter:
    """A drafter directory, checked against the target when its embeddings are given (every drafter
    made for a target is loaded so): mismatches fail here, not in the first draft step."""
    path = Path(path)
    source = f"drafter {path}"
    cfg = read_drafter_config(path)
    tensors = dequantize_int8({_standard_name(n): t for n, t in iter_safetensors(path)}, source)
    own = "embed_tokens.weight" in tensors
    if not own and target_embeddings is None:
        raise ValueError(f"{source} has no embed_tokens.weight and no target embeddings were given")
    if target_embeddings is not None:
        vocab, hidden = target_embeddings.vocab_size, target_embeddings.weight.shape[1]
        if (cfg.vocab_size, cfg.target_hidden_size) != (vocab, hidden):
            raise ValueError(
                f"{source} was made for a target with {cfg.vocab_size} tokens and hidden size "
                f"{cfg.target_hidden_size}, not this one ({vocab}, {hidden})"
            )
        if not own and cfg.hidden_size != hidden:
            raise ValueError(
                f"{source} has hidden size {cfg.hidden_size} but no embed_tokens.weight of its "
                f"own: the target's are {hidden} wide"
            )
    num_aux = (
        len(cfg.aux_layer_ids) if cfg.aux_layer_ids else 3
    )  # the target's default (2, L/2, L-3)
    drafter = Eagle3Drafter(cfg, num_aux, group, max_positions, None if own else target_embeddings)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if d2t is None or t2d is None:
        raise ValueError(f"{source} lacks {'d2t' if d2t is None else 't2d'}")
    if d2t.shape != (cfg.draft_vocab_size,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(
            f"{source}: d2t must be {cfg.draft_vocab_size} integers, "
            f"not {d2t.dtype} {list(d2t.shape)}"
        )
    target_ids = torch.arange(cfg.draft_vocab_size) + d2t
    if cfg.draft_vocab_size and not 0 <= target_ids.min() <= target_ids.max() < cfg.vocab_size:
        raise ValueError(
            f"{source}: d2t maps draft tokens to ids outside the {cfg.vocab_size}-token vocabulary"
        )
    if t2d.shape != (cfg.vocab_size,) or t2d.dtype != torch.bool:
        raise ValueError(
            f"{source}: t2d must be {cfg.vocab_size} bools, not {t2d.dtype} {list(t2d.shape)}"
        )
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    load_weights(drafter, tensors.items(), source, () if own else ("embed_tokens",))
    return drafter


def drafter_state_dict(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """Standard-format tensors of an unsharded (TP=1) drafter."""
    heads, kv = drafter.cfg.num_attention_heads, drafter.cfg.num_key_value_heads
    D = drafter.cfg.head_dim
    layer = drafter.midlayer
    q, k, v = layer.self_attn.qkv_proj.weight.split([heads * D, kv * D, kv * D])
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    state = {
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": layer.mlp.down_proj.weight,
        "midlayer.input_layernorm.weight": layer.input_layernorm.weight,
        "midlayer.hidden_norm.weight": layer.hidden_norm.weight,
        "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "fc.weight": drafter.fc.weight,
        "norm.weight": drafter.norm.weight,
        "lm_head.weight": drafter.lm_head.weight,
        "d2t": drafter.d2t,
        "t2d": drafter.t2d,
    }
    if drafter.has_own_embeddings:
        state["embed_tokens.weight"] = drafter.embed_tokens.weight
    return {n: t.detach().contiguous().cpu() for n, t in state.items()}


def save_drafter(
    path: Path,
    cfg: DrafterConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json + the weights in the standard EAGLE-3 layout: model.safetensors, or, when
    they exceed `max_shard_bytes`, model-0000i-of-0000n.safetensors +
    model.safetensors.index.json (the Hugging Face layout). Weight files of an earlier save that
    are not rewritten are removed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():  # in order, a new shard once the current one would overflow
        if (
            max_shard_bytes is not None
            and shards[-1]
            and shard_bytes + tensor.nbytes > max_shard_bytes
        ):
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.contiguous()
        shard_bytes += tensor.nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        save_file(shard, str(path / name))
    index = path / "model.safetensors.index.json"
    if len(shards) > 1:
        index.write_text(
            json.dumps(
                {
                    "metadata": {"total_size": sum(t.nbytes for t in state.values())},
                    "weight_map": {
                        tensor: name for name, shard in zip(names, shards) for tensor in shard
                    },
                },
                indent=2,
            )
        )
    else:
        index.unlink(missing_ok=True)
    for stale in set(path.glob("model*.safetensors")) - {path / n for n in names}:
        stale.unlink()  # it would be loaded beside the new files
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))


def drafter_tensors(cfg: DrafterConfig, w, num_aux: int = 3, dtype=torch.float32) -> dict:
    """The standard layout's layer, fc, norm and lm_head tensors: weights w(*shape), in order."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        "midlayer.self_attn.q_proj.weight": w(heads * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(kv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(kv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, heads * D),
        "midlayer.mlp.gate_proj.weight": w(I, H),
        "midlayer.mlp.up_proj.weight": w(I, H),
        "midlayer.mlp.down_proj.weight": w(H, I),
        "midlayer.input_layernorm.weight": torch.ones(H, dtype=dtype),
        "midlayer.hidden_norm.weight": torch.ones(H, dtype=dtype),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
        "fc.weight": w(H, num_aux * cfg.target_hidden_size),
        "norm.weight": torch.ones(H, dtype=dtype),
        "lm_head.weight": w(cfg.draft_vocab_size, H),
    }


def random_drafter_state(
    cfg: DrafterConfig, num_aux: int = 3, seed: int = 0, with_embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """Random weights in the standard layout, an identity d2t (draft vocab = first ids)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    state = drafter_tensors(cfg, w, num_aux)
    state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    state["t2d"] = torch.arange(cfg.vocab_size) < cfg.draft_vocab_size
    if with_embeddings:
        state["embed_tokens.weight"] = w(cfg.vocab_size, cfg.hidden_size)
    return state


def drafter_config_for(
    target_cfg, draft_vocab_size: int | None = None, aux_layer_ids: tuple[int, ...] | None = None
) -> DrafterConfig:
    """A drafter config shaped like one layer of the target (what EAGLE-3 trains by default)."""
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling,
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=draft_vocab_size or target_cfg.vocab_size,
        target_hidden_size=target_cfg.hidden_size,
        aux_layer_ids=aux_layer_ids,
    )


DEFAULT_DRAFTERS = {"smollm2-135m": Path(__file__).parent / "drafters" / "smollm2-135m"}


def drafter_dir(name: str) -> Path:
    """A drafter given as a directory, or an error that says what is wrong with it."""
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"drafter {name!r}: not 'default', 'none' or a directory with config.json"
        )
    return path


def resolve_drafter(name: str, model: str, target_cfg) -> Path:
    """ "default" -> the project's trained drafter for this model, else a random-weight drafter
    (acceptance near zero, output still exact); anything else is a drafter directory."""
    if name != "default":
        return drafter_dir(name)
    trained = DEFAULT_DRAFTERS.get(model)
    if trained is not None and (trained / "config.json").is_file():
        return trained
    cfg = drafter_config_for(target_cfg)
    # keyed by shape too: two models whose directories share a name must not share a drafter
    shape = hashlib.sha1(json.dumps(cfg.to_hf(), sort_keys=True).encode()).hexdigest()[:10]
    path = cache_root() / f"random-drafter-{Path(model).name}-{shape}"
    if not (path / "config.json").is_file():
        save_drafter(path, cfg, random_drafter_state(cfg))
    return path
