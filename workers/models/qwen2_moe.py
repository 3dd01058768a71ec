"""Qwen1.5-MoE and Qwen2-MoE: Qwen2's biased q, k, v with sparse blocks that add a shared expert
(gated by a sigmoid) to the routed ones, whose weights are not renormalized by default."""

from workers.models.decoder import DecoderModel
from workers.models.sparse_moe import MoeDecoderLayer


class Qwen2MoeLayer(MoeDecoderLayer):
    qkv_bias = True


class Qwen2Moe(DecoderModel):
    layer_class = Qwen2MoeLayer
