"""The decoder loop every target family shares: embed, layers, norm, logits, with the EAGLE-3
auxiliary-state capture. A family file supplies its layer; nothing here knows about drafting
beyond copying the residual stream at the configured layers into a buffer it is handed."""

import torch
from torch import nn

from workers.layers.activation import swiglu
from workers.layers.attention import AttentionInputs, CachedAttention, attention_inputs
from workers.layers.kv_cache import ForwardBatch
from workers.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from workers.layers.rotary import Rotary
from workers.models.config import ModelConfig


class MLP(nn.Module):
    """SwiGLU: gate and up column-parallel (one fused projection), down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, group=None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], group)
        self.down_proj = RowParallelLinear(intermediate, hidden, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals (Llama's layer). A family's layer may set
    `qkv_bias` (Qwen2) or `qk_norm` (Qwen3), or make another feed-forward block (`make_mlp`)."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: ModelConfig, rotary: Rotary, group=None, layer_id: int = 0):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = CachedAttention(
            H,
            H,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            rotary,
            group,
            qkv_bias=self.qkv_bias or cfg.attention_bias,
            qk_norm_eps=cfg.rms_norm_eps if self.qk_norm else None,
            o_bias=cfg.attention_bias,
            sliding_window=cfg.sliding_window if layer_id in cfg.sliding_layers else None,
            sinks=cfg.attention_sinks,
        )
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, group, layer_id)

    def make_mlp(self, cfg: ModelConfig, group, layer_id: int) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, group)

    def forward(
        self, h: torch.Tensor, batch: ForwardBatch, inputs: AttentionInputs
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch, inputs)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """A tensor-parallel decoder-only target. Subclasses set `layer_class`."""

    layer_class = DecoderLayer

    def __init__(
        self,
        cfg: ModelConfig,
        group=None,
        max_positions: int = 4096,
        aux_layer_ids: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        if aux_layer_ids is None:
            aux_layer_ids = cfg.default_aux_layer_ids()
        self.aux_layer_ids = tuple(aux_layer_ids)
        for i in self.aux_layer_ids:
            if not 0 <= i < cfg.num_hidden_layers:
                raise ValueError(
                    f"aux hidden-state layer id {i} outside 0..{cfg.num_hidden_layers - 1}"
                )
        self.rotary = Rotary(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, self.rotary, group, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def checkpoint_tensors(tensors):
        """(name, tensor) pairs as the checkpoint holds them -> as load_weights reads them (a
        family whose checkpoints fuse or quantize tensors differently converts them here)."""
        return tensors

    def attention_modules(self) -> list[CachedAttention]:
        return [layer.self_attn for layer in self.layers]

    def forward(
        self, ids: torch.Tensor, batch: ForwardBatch, aux_out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> final normed hidden [B, T, H], aux features [B, T, len(aux) * H].
        The aux features are the residual stream entering each aux layer (HF `hidden_states[i]`),
        copied into `aux_out` (the resource manager's buffer) when given."""
        H = self.cfg.hidden_size
        if aux_out is None:
            width = len(self.aux_layer_ids) * H
            aux_out = ids.new_empty(*ids.shape, width, dtype=self.norm.weight.dtype)
        h = self.embed_tokens(ids)
        window = self.cfg.sliding_window if self.cfg.sliding_layers else None
        inputs = attention_inputs(batch, self.layers[0].self_attn, h.dtype, window=window)
        for i, layer in enumerate(self.layers):
            for j, layer_id in enumerate(self.aux_layer_ids):
                if layer_id == i:
                    aux_out[..., j * H : (j + 1) * H].copy_(h, non_blocking=True)
            h = layer(h, batch, inputs)
        return self.norm(h), aux_out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
