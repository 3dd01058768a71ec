"""The target model: a tensor-parallel Llama that captures EAGLE-3 auxiliary hidden states."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention import AttentionInputs, CachedAttention, ForwardBatch, attention_inputs
from workers.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class LlamaConfig:
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
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "LlamaConfig":
        """A Hugging Face config.json, refused (naming `source`) unless it is a Llama this code runs as-is."""

        def refuse(problem: str) -> ValueError:
            return ValueError(f"{source}: {problem}")

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
            raise refuse(
                f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
            )
        if head_dim is None and hidden % heads:
            raise refuse(
                f"num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim)"
            )
        return cls(
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
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )

    def max_len(self, requested: int) -> int:
        """The sequence length served: the requested one, within the model's positions."""
        return min(requested, self.max_position_embeddings)

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        L = self.num_hidden_layers
        return (2, L // 2, L - 3)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, group=None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], group)
        self.down_proj = RowParallelLinear(intermediate, hidden, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: Rotary, group=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = CachedAttention(
            cfg.hidden_size,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            rotary,
            group,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, group)

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, inputs: AttentionInputs
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch, inputs)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        group=None,
        max_positions: int = 4096,
        aux_layer_ids: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.aux_layer_ids = tuple(
            aux_layer_ids if aux_layer_ids is not None else cfg.default_aux_layer_ids()
        )
        for i in self.aux_layer_ids:
            if not 0 <= i < cfg.num_hidden_layers:
                raise ValueError(
                    f"aux hidden-state layer id {i} outside 0..{cfg.num_hidden_layers - 1}"
                )
        self.rotary = Rotary(cfg.head_dim, max_positions, cfg.rope_theta)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary, group) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, ids: torch.Tensor, batch: ForwardBatch, aux_out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> final normed hidden [B, T, H], aux features [B, T, len(aux) * H].
        The aux features are the residual stream entering each aux layer (HF `hidden_states[i]`),
        copied into `aux_out` (the resource manager's buffer) when given."""
        H = self.cfg.hidden_size
        if aux_out is None:
            aux_out = ids.new_empty(
                *ids.shape, len(self.aux_layer_ids) * H, dtype=self.norm.weight.dtype
            )
        h = self.embed_tokens(ids)
        inputs = attention_inputs(batch, self.layers[0].self_attn, h.dtype)
        for i, layer in enumerate(self.layers):
            for j, layer_id in enumerate(self.aux_layer_ids):
                if layer_id == i:
                    aux_out[..., j * H : (j + 1) * H].copy_(h, non_blocking=True)
            h = layer(h, batch, inputs)
        return self.norm(h), aux_out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
