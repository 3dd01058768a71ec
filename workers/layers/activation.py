"""The gated activation of the feed-forward blocks (dense and experts): SwiGLU, and gpt-oss's
clamped variant."""

import torch
import torch.nn.functional as F

GPT_OSS_ALPHA = 1.702  # gpt-oss's sigmoid slope in its SwiGLU


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> [..., I]: SiLU(gate) * up; with a limit, gpt-oss's variant
    (gate clamped above, up on both sides, gate * sigmoid(1.702 gate) * (up + 1))."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)
