"""A rank's models: the target shard (its family from the registry) and the drafter shard, from
disk, or random weights built on the device for `random:<shape>` targets and the `random`
drafter (speed measurements of large shapes). With `quantization: fp8` the target's linear
layers are quantized to FP8 once loaded (an FP8 checkpoint's are FP8 as stored); the drafter
stays in the run's dtype."""

from pathlib import Path

import torch

from speculative.drafter import Eagle3Drafter
from speculative.drafter_format import (
    drafter_config_for,
    load_drafter,
    read_drafter_config,
    resolve_drafter,
)
from workers.layers.fp8 import cast_
from workers.layers.moe import ExpertWeights
from workers.layers.parallel import QuantizableLinear
from workers.models import ModelConfig, model_class
from workers.models.loader import load_target_weights


def init_random_(model: torch.nn.Module, keep: torch.nn.Module | None = None) -> None:
    """Random weights, except those `model` shares with `keep` (the drafter's embedding is the
    target's: drawing it again would change the target)."""
    kept = {p.data_ptr() for p in keep.parameters()} if keep is not None else set()
    for name, p in model.named_parameters():
        if p.data_ptr() in kept:
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02)


def load_models(
    cfg,
    target_cfg: ModelConfig,
    model_dir: Path,
    group,
    device: torch.device,
    dtype: torch.dtype,
    cache_len: int,
):
    """-> (target, drafter); the drafter is None for plain decoding."""
    random_target = cfg.model.startswith("random:")
    drafter_dir = None
    if cfg.speculative and cfg.drafter not in ("random", "ngram"):
        drafter_dir = resolve_drafter(cfg.drafter, cfg.model, target_cfg)
    # plain decoding and n-gram drafts capture no aux hidden states (and work for targets of
    # any depth)
    aux_ids = None if cfg.speculative and cfg.drafter != "ngram" else ()
    if drafter_dir:
        aux_ids = read_drafter_config(drafter_dir).aux_layer_ids
    with torch.device(device if random_target else "cpu"):
        target = model_class(target_cfg)(target_cfg, group, cache_len, aux_ids)
    if random_target:
        init_random_(target)
    else:
        load_target_weights(target, model_dir)
    if cfg.quantization == "fp8" and target_cfg.quantization is None:
        quantize_fp8_(target)
    cast_(target, device, dtype)
    drafter = None
    if cfg.drafter == "random" and cfg.speculative:
        with torch.device(device):
            drafter = Eagle3Drafter(
                drafter_config_for(target_cfg),
                group=group,
                max_positions=cache_len,
                embed_tokens=target.embed_tokens,
            )
        init_random_(drafter, keep=target)
    elif drafter_dir is not None:
        drafter = load_drafter(drafter_dir, group, target.embed_tokens, cache_len)
    if drafter is not None:
        drafter.to(device, dtype)
    return target, drafter


def quantize_fp8_(model: torch.nn.Module) -> None:
    """Every linear layer's and expert's weight (this rank's shard) to FP8, a scale per output
    row: better than vLLM's one scale per tensor for `--quantization fp8`, at no cost in the
    matmul. Routers stay in the model's dtype."""
    for module in model.modules():
        if isinstance(module, QuantizableLinear | ExpertWeights) and module.weight_scale is None:
            module.use_fp8(quantize=True)


def weight_bytes(*models: torch.nn.Module | None) -> int:
    """Bytes of this rank's weights and buffers, each tensor once (the drafter shares the
    target's embeddings)."""
    tensors = {
        t.data_ptr(): t.nbytes
        for model in models
        if model is not None
        for t in (*model.parameters(), *model.buffers())
    }
    return sum(tensors.values())
