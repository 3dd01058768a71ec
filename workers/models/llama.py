"""Llama (1, 2 and 3.x with default RoPE): the shared decoder as it is."""

from workers.models.decoder import DecoderLayer, DecoderModel


class Llama(DecoderModel):
    layer_class = DecoderLayer
