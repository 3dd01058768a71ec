"""Mixtral: Mistral's attention with a sparse block in every layer (top-2 of 8 experts,
renormalized). Its checkpoints name the block `block_sparse_moe` and the experts' projections
w1 (gate), w3 (up) and w2 (down): the loader reads them as the Qwen names."""

from workers.models.decoder import DecoderModel
from workers.models.sparse_moe import MoeDecoderLayer


class Mixtral(DecoderModel):
    layer_class = MoeDecoderLayer
