"""Mistral: Llama's layer. Its `sliding_window` is served only while the context fits in the
window (ModelConfig.max_len refuses a shorter one), where the window masks nothing."""

from workers.models.decoder import DecoderLayer, DecoderModel


class Mistral(DecoderModel):
    layer_class = DecoderLayer
