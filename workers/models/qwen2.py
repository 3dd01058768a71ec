"""Qwen2 and Qwen2.5: Llama's layer with a bias on the q, k and v projections (not on o)."""

from workers.models.decoder import DecoderLayer, DecoderModel


class Qwen2Layer(DecoderLayer):
    qkv_bias = True


class Qwen2(DecoderModel):
    layer_class = Qwen2Layer
