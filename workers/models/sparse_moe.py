"""The feed-forward block of the mixture-of-experts families: a replicated router picks each
token's top-k experts (workers/layers/moe.py runs them), plus Qwen2-MoE's shared expert, gated by
a sigmoid, that every token takes. Layers a config leaves dense keep the SwiGLU MLP."""

import torch
from torch import nn

from workers.layers.moe import Experts, Router, route
from workers.models.config import ModelConfig
from workers.models.decoder import MLP, DecoderLayer


class SparseMoeBlock(nn.Module):
    """x [..., H] -> [..., H]; modules named as the Hugging Face checkpoints name them (gate,
    experts, shared_expert, shared_expert_gate)."""

    def __init__(self, cfg: ModelConfig, group=None):
        super().__init__()
        moe, H = cfg.moe, cfg.hidden_size
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Router(H, moe.num_experts, moe.bias)
        self.experts = Experts(
            moe.num_experts, H, moe.intermediate_size, group, moe.bias, moe.swiglu_limit
        )
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(H, moe.shared_expert_size, group)
            self.shared_expert_gate = Router(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        weights, ids = route(self.gate(rows), self.top_k, self.renormalize)
        out = self.experts(rows, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(rows))
            out = out + gate * self.shared_expert(rows)
        return out.view_as(x)


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is the sparse block where the config makes it sparse."""

    def make_mlp(self, cfg: ModelConfig, group, layer_id: int) -> nn.Module:
        if cfg.moe.sparse(layer_id):
            return SparseMoeBlock(cfg, group)
        return super().make_mlp(cfg, group, layer_id)
