"""Qwen3 (dense): Llama's layer with an RMSNorm over each query and key head before RoPE; its
head_dim is explicit in config.json and need not be hidden_size / heads."""

from workers.models.decoder import DecoderLayer, DecoderModel


class Qwen3Layer(DecoderLayer):
    qk_norm = True


class Qwen3(DecoderModel):
    layer_class = Qwen3Layer
