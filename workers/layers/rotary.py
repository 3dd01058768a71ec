"""Rotary position embeddings: the frequencies of each published RoPE variant, the tables every
layer of a forward shares, and applying them.

The frequencies follow transformers' ROPE_INIT_FUNCTIONS (tests/test_models.py compares them):
`rope` is a config's rope parameters as `config.rope_parameters` reads them (rope_type, factor,
original_max_position_embeddings, ...); None or rope_type "default" is plain RoPE."""

import math

import torch
from torch import nn

# transformers' types, and GGUF's: llama.cpp's rope_freqs.weight, per-frequency divisors
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The base frequencies of RoPE, one per pair of dimensions [head_dim / 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Wavelengths below original/high_freq_factor keep their frequency, those above
    original/low_freq_factor are divided by factor, and those between are blended by
    smooth = (original / wavelength - low) / (high - low)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(is_medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(head_dim: int, theta: float, rope: dict) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that rotate fewer than beta_slow times over the original context are
    interpolated (divided by factor), those rotating more than beta_fast times are kept, a linear
    ramp between; cos and sin are scaled by the attention factor."""
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        attention_factor = yarn_mscale(factor)
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention_factor)


def rope_frequencies(
    head_dim: int, theta: float, rope: dict | None = None
) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim / 2], the factor cos and sin are scaled by)."""
    rope_type = (rope or {}).get("rope_type", "default")
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, rope)
    inv_freq = default_inv_freq(head_dim, theta)
    if rope_type == "linear":
        return inv_freq / rope["factor"], 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, rope), 1.0
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(rope["factors"], dtype=torch.float32), 1.0
    # dynamic NTK rescales only once a sequence outgrows max_position_embeddings, and the served
    # context never does (ModelConfig.max_len): within it, transformers' frequencies are these
    assert rope_type in ("default", "dynamic"), rope_type
    return inv_freq, 1.0


class Rotary(nn.Module):
    """Rotate-half RoPE (the Hugging Face Llama convention) from a precomputed table. The sine
    table carries rotate-half's sign, so x * cos + rotate_half(x) * sin is
    x * cos + roll(x) * sin: three kernels, applied to queries and keys together."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope: dict | None = None):
        super().__init__()
        inv_freq, attention_factor = rope_frequencies(head_dim, theta, rope)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
        sin[:, : head_dim // 2] *= -1
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", sin, persistent=False)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, signed sin [B, T, 1, D]: once per forward, for every layer."""
        cos = self.cos[positions].unsqueeze(2).to(dtype)
        sin = self.sin[positions].unsqueeze(2).to(dtype)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [B, T, heads, D], positions: [B, T]
        return self.apply(x, *self.tables(positions, x.dtype))
