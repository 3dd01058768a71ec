"""The target's checked model config: read once from config.json, then passed down."""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from workers.layers.rotary import ROPE_TYPES
from workers.models.quantization import check_quantization

log = logging.getLogger(__name__)

# architecture -> model_type; keep in step with MODELS in models/__init__.py
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
GPT_OSS = "GptOssForCausalLM"
MOE_ARCHITECTURES = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", GPT_OSS}
# known families this code cannot run yet, and what they lack
REFUSED_FAMILIES = {
    "deepseek_v3": "DeepSeek-V3 needs multi-head latent attention, which is not supported",
}
# fields that mean a model this code would run wrongly: refused by name
UNSUPPORTED_FIELDS = {
    "num_experts": "mixture-of-experts layers outside the MoE families",
    "num_local_experts": "mixture-of-experts layers outside the MoE families",
    "n_routed_experts": "DeepSeek-style routed experts",
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "q_lora_rank": "multi-head latent attention (MLA)",
    "vision_config": "a multimodal model",
    "audio_config": "a multimodal model",
    "text_config": "a multimodal model (its text model's config is nested)",
}
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",)}
ROPE_REQUIRED["llama3"] = ("factor", "low_freq_factor", "high_freq_factor")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as e:  # invalid JSON or not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def load_config(model_dir: Path) -> dict:
    """A model directory's config.json, as a dict."""
    return read_json(Path(model_dir) / "config.json")


def eos_token_ids(model_dir: Path) -> set[int]:
    """The ids that end generation: config.json's eos_token_id and generation_config.json's (an
    id or a list: Llama 3 Instruct ends on any of three)."""
    ids = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        eos = read_json(path).get("eos_token_id") if path.is_file() else None
        ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    return ids


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts target's expert layers (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights rescaled to sum to one
    shared_expert_size: int = 0  # Qwen2-MoE's gated shared expert, beside the routed ones
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP instead
    bias: bool = False  # gpt-oss: biases in the router and the experts
    swiglu_limit: float | None = None  # gpt-oss: its clamped SwiGLU (workers/layers/moe.py)

    def sparse(self, layer_id: int) -> bool:
        return layer_id not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    rope_scaling: dict | None = field(default=None, compare=False)  # rotary.rope_frequencies'
    # Mistral's, served only while the context fits in it; gpt-oss's, in sliding_layers
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attention_bias: bool = False  # biased q, k, v and o projections (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    quantization: str | None = None  # the FP8 checkpoint's quant_method (models/quantization.py)
    moe: MoeConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """A Hugging Face config.json, refused (naming `source`) unless this code runs it as-is."""
        return cls(**_checked_fields(cfg, lambda problem: ValueError(f"{source}: {problem}")))

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        return cls.from_hf(load_config(model_dir), str(Path(model_dir) / "config.json"))

    def max_len(self, requested: int | None) -> int:
        """The sequence length served: max_model_len within the model's positions (a larger one
        is capped, with a warning); by default all of them, or a sliding window's worth."""
        limit = self.max_position_embeddings
        capped = self.sliding_window is not None and not self.sliding_layers
        if requested is None and capped:
            limit = min(limit, self.sliding_window)  # served only while the window masks nothing
        max_len = min(requested or limit, limit)
        if max_len < (requested or 0):
            log.warning(
                "max_model_len %d is capped to the model's max_position_embeddings, %d",
                requested,
                max_len,
            )
        if capped and self.sliding_window < max_len:
            raise ValueError(
                f"sliding_window {self.sliding_window} is shorter than the context in use "
                f"({max_len}); sliding-window attention is not supported: serve with "
                f"max_model_len <= {self.sliding_window}"
            )
        return max_len

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        L = self.num_hidden_layers
        return (2, L // 2, L - 3)


def _check_family(cfg: dict, refuse) -> str:
    arch = cfg.get("architectures") or ["LlamaForCausalLM"]
    model_type = cfg.get("model_type", "llama")
    if model_type in REFUSED_FAMILIES:
        raise refuse(f"model_type {model_type!r}: {REFUSED_FAMILIES[model_type]}")
    if len(arch) != 1 or SUPPORTED_ARCHITECTURES.get(arch[0]) != model_type:
        raise refuse(
            f"model_type {model_type!r}, architectures {arch}: supported are "
            + ", ".join(f"{a} ({t})" for a, t in SUPPORTED_ARCHITECTURES.items())
        )
    for key, what in UNSUPPORTED_FIELDS.items():
        expert_count = key in ("num_experts", "num_local_experts")
        if cfg.get(key) and not (expert_count and arch[0] in MOE_ARCHITECTURES):
            raise refuse(f"{key} is set: {what} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key) and not (key == "attention_bias" and arch[0] == GPT_OSS):
            raise refuse(f"{key} is set; layers with biases are not supported")
    sliding = "sliding_attention" in (cfg.get("layer_types") or []) and arch[0] != GPT_OSS
    if cfg.get("use_sliding_window") or sliding:
        key = "use_sliding_window" if cfg.get("use_sliding_window") else "layer_types"
        raise refuse(f"{key}: sliding-window attention layers are not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"partial_rotary_factor {cfg['partial_rotary_factor']} is not supported")
    return arch[0]


def rope_parameters(cfg: dict, refuse) -> tuple[float, dict | None]:
    """-> (theta, the scaling parameters, None for plain RoPE), from rope_parameters
    (transformers 5) or rope_scaling + rope_theta, with transformers' defaults filled in."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope_type not in ROPE_TYPES:
        raise refuse(f"{key}: unsupported rope type {rope_type!r} (supported: {ROPE_TYPES})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"{key}.partial_rotary_factor {rope['partial_rotary_factor']} is unsupported")
    if not isinstance(theta, int | float) or theta <= 1:
        raise refuse(f"rope_theta must be a number above 1, not {theta!r}")
    if rope_type == "default":
        return float(theta), None
    for name in ROPE_REQUIRED.get(rope_type, ()):
        if not isinstance(rope.get(name), int | float):
            raise refuse(f"{key} of type {rope_type!r} lacks a number {name}")
    max_positions = cfg.get("max_position_embeddings", 2048)
    rope.setdefault("original_max_position_embeddings", max_positions)
    if rope_type == "yarn" and rope.get("factor") is None:
        rope["factor"] = max_positions / rope["original_max_position_embeddings"]
    if rope_type == "llama3" and rope["low_freq_factor"] == rope["high_freq_factor"]:
        raise refuse(f"{key}: low_freq_factor equals high_freq_factor")
    rope = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    return float(theta), rope | {"rope_type": rope_type}


def _checked_fields(cfg: dict, refuse) -> dict:
    architecture = _check_family(cfg, refuse)
    quantization = check_quantization(cfg, refuse)
    theta, rope = rope_parameters(cfg, refuse)

    def number(key: str, default=..., kind=int):  # default ...: required
        value = cfg.get(key)
        if value is None:
            if default is ...:
                raise refuse(f"lacks {key}")
            return default
        if type(value) not in (int, kind) or not value > 0:
            raise refuse(f"{key} must be a positive {kind.__name__}, not {value!r}")
        return value

    heads, hidden = number("num_attention_heads"), number("hidden_size")
    kv_heads, head_dim = number("num_key_value_heads", heads), number("head_dim", None)
    if heads % kv_heads:
        raise refuse(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    if head_dim is None and hidden % heads:
        raise refuse(
            f"num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim)"
        )
    return dict(
        vocab_size=number("vocab_size"),
        hidden_size=hidden,
        intermediate_size=number("intermediate_size"),
        num_hidden_layers=number("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        rms_norm_eps=number("rms_norm_eps", 1e-5, float),
        rope_theta=theta,
        max_position_embeddings=number("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        architecture=architecture,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        rope_scaling=rope,
        sliding_window=number("sliding_window", None)
        if architecture in ("MistralForCausalLM", "MixtralForCausalLM", GPT_OSS)
        else None,
        quantization=quantization,
        moe=_moe_config(cfg, architecture, number, refuse),
    ) | (_gpt_oss_attention(cfg) if architecture == GPT_OSS else {})


def _gpt_oss_attention(cfg: dict) -> dict:
    """gpt-oss: biased projections, sinks in every layer, a sliding window in the layers
    layer_types names (by default every other one from the first, as transformers has it)."""
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return dict(sliding_layers=sliding, attention_bias=True, attention_sinks=True)


def _moe_config(cfg: dict, architecture: str, number, refuse) -> MoeConfig | None:
    """Mixtral's experts are intermediate_size wide, every layer sparse, weights renormalized;
    Qwen's are moe_intermediate_size wide, in the layers that decoder_sparse_step and
    mlp_only_layers leave sparse, renormalized where norm_topk_prob says."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    experts = cfg.get("num_experts") or number("num_local_experts")
    top_k = number("num_experts_per_tok")
    if not (isinstance(experts, int) and 0 < top_k <= experts):
        raise refuse(f"num_experts_per_tok {top_k} must be 1..num_experts ({experts!r})")
    if architecture == "MixtralForCausalLM":
        return MoeConfig(experts, top_k, number("intermediate_size"), renormalize=True)
    if architecture == GPT_OSS:  # softmax over the top k logits: renormalized
        limit = number("swiglu_limit", 7.0, float)
        alpha = cfg.get("swiglu_alpha", 1.702)
        if alpha != 1.702:
            raise refuse(f"swiglu_alpha {alpha!r} is not supported (only gpt-oss's 1.702)")
        inter = number("intermediate_size")
        return MoeConfig(experts, top_k, inter, True, bias=True, swiglu_limit=float(limit))
    step = number("decoder_sparse_step", 1)
    layers = number("num_hidden_layers")
    dense = set(cfg.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    shared = number("shared_expert_intermediate_size", 0) if "Qwen2" in architecture else 0
    return MoeConfig(
        experts,
        top_k,
        number("moe_intermediate_size"),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_size=shared,
        dense_layers=tuple(sorted(dense)),
    )
