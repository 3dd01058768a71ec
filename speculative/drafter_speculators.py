"""vLLM's speculators format for EAGLE-3 heads (`Eagle3Speculator`): a top-level config with the
EAGLE-3 fields and the decoder layer's own config nested in `transformer_layer_config`, tensors
named `layers.0.*` (drafter_format._standard_name reads them as `midlayer.*`).

The nested layer is Llama's, or speculators' "Qwen3" layer, which is Llama's layer with an
explicit head_dim (no q/k norm): both are the drafter's Eagle3Layer. Each flag the format defines
is honoured or refused here, by name."""

LAYER_TYPES = ("llama", "qwen3")
ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
# top-level keys read here, and those only training reads (ignored when serving)
EAGLE3_KEYS = {
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
}
TRAINING_ONLY = {"enable_sp_ulysses", "embed_requires_grad"}
FORMAT_KEYS = {
    "architectures",
    "speculators_model_type",
    "speculators_version",
    "speculators_config",
    "transformer_layer_config",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "auto_map",
    "has_no_defaults_at_init",
}


def is_speculators(cfg: dict) -> bool:
    architectures = cfg.get("architectures") or []
    return "transformer_layer_config" in cfg or any(a in ARCHITECTURES for a in architectures)


def flat_config(cfg: dict) -> dict:
    """A speculators config -> the flat (EAGLE authors') drafter config dict, or a ValueError
    naming what this engine does not run."""
    if cfg.get("speculators_model_type", "eagle3") != "eagle3":
        raise ValueError(f"speculators_model_type {cfg['speculators_model_type']!r} is not eagle3")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config lacks transformer_layer_config")
    if layer.get("model_type", "llama") not in LAYER_TYPES:
        raise ValueError(
            f"transformer_layer_config.model_type {layer['model_type']!r} is not supported "
            f"(supported: {LAYER_TYPES})"
        )
    unknown = set(cfg) - EAGLE3_KEYS - TRAINING_ONLY - FORMAT_KEYS
    flagged = sorted(key for key in unknown if cfg[key] not in (None, False, 0, [], {}))
    if flagged:
        raise ValueError(f"speculators config field(s) {flagged} are not supported")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    flat |= {key: cfg[key] for key in EAGLE3_KEYS if cfg.get(key) is not None}
    # speculators' own default (Eagle3SpeculatorConfig) when a file leaves the flag out
    flat.setdefault("norm_before_residual", False)
    return flat
