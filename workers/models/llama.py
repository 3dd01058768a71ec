"""Llama 1, 2 and 3.x (every RoPE variant of layers/rotary.py): the shared decoder as it is."""

from workers.models.decoder import DecoderLayer, DecoderModel


class Llama(DecoderModel):
    layer_class = DecoderLayer
