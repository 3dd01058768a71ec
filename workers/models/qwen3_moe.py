"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's per-head q and k norms, sparse blocks of
many narrow experts (8 of 128), weights renormalized where norm_topk_prob is set."""

from workers.models.decoder import DecoderModel
from workers.models.sparse_moe import MoeDecoderLayer


class Qwen3MoeLayer(MoeDecoderLayer):
    qk_norm = True


class Qwen3Moe(DecoderModel):
    layer_class = Qwen3MoeLayer
