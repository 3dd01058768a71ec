"""The target's checked model config: read once from config.json, then passed down."""

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)  # keep in step with models/__init__.py


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

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """A Hugging Face config.json, refused (naming `source`) unless this code runs it as-is."""
        return cls(**_checked_fields(cfg, lambda problem: ValueError(f"{source}: {problem}")))

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        return cls.from_hf(load_config(model_dir), str(Path(model_dir) / "config.json"))

    def max_len(self, requested: int) -> int:
        """The sequence length served: the requested one, within the model's positions."""
        return min(requested, self.max_position_embeddings)

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        L = self.num_hidden_layers
        return (2, L // 2, L - 3)


def _checked_fields(cfg: dict, refuse) -> dict:
    arch = cfg.get("architectures") or ["LlamaForCausalLM"]
    if cfg.get("model_type", "llama") != "llama" or arch != ["LlamaForCausalLM"]:
        raise refuse(
            f"model_type {cfg.get('model_type')!r}, architectures {arch}: only Llama "
            "(LlamaForCausalLM) is supported"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise refuse(f"{key} is set; layers with biases are not supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise refuse(f"unsupported rope scaling {rope_type!r}")

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
        rope_theta=number("rope_theta", rope.get("rope_theta", 10000.0), float),
        max_position_embeddings=number("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        architecture=arch[0],
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )
