"""Rotary position embeddings: the tables every layer of a forward shares, and applying them."""

import torch
from torch import nn


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The base frequencies of RoPE, one per pair of dimensions [head_dim / 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponents)


class Rotary(nn.Module):
    """Rotate-half RoPE (the Hugging Face Llama convention) from a precomputed table. The sine
    table carries rotate-half's sign, so x * cos + rotate_half(x) * sin is
    x * cos + roll(x) * sin: three kernels, applied to queries and keys together."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = default_inv_freq(head_dim, theta)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        sin[:, : head_dim // 2] *= -1
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_positions, head_dim]
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
