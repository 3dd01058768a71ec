"""FP8 (E4M3) weights and KV rows: quantizing, and the matmul of FP8 weights.

A weight is FP8 rows with a float32 scale per output row (a checkpoint's per-tensor scale is
that scale repeated over its rows). Activations are quantized per token as they come (dynamic
scales), as the FP8_DYNAMIC checkpoints expect. On CUDA with FP8 tensor cores (compute
capability 8.9: Ada, Hopper) `torch._scaled_mm` multiplies the FP8 operands with row-wise
scales; elsewhere (CPU, older GPUs) the same FP8 activations and weights are multiplied in a
wider dtype and scaled after, so a CPU test sees the GPU path's quantization.

A decode, verify or draft step's few rows only read their weights, and there quantizing the
activations costs launches and buys nothing: outside prefill (`prefill_forward()`), the FP8
weights are widened against the activations as they are (on CUDA the Triton kernel of
fp8_weight_only.py, elsewhere the same product in float32). The path follows the kind of forward,
never its number of rows: a token gets the same numerics whichever batch it shares, so
speculative greedy output stays plain greedy's (a verify pass of B x (K+1) rows and plain
decoding's B rows take one path). Every step is a device op (no host sync): the matmul captures
in CUDA graphs."""

import contextlib
import functools
import os

import torch
import torch.nn.functional as F

from workers.layers.attention_backend import num_sms

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# a row of zeros (a padding token) gets this scale, not a division by zero
MIN_SCALE = 1.0 / (FP8_MAX * 512)
_in_prefill = False  # set around the target's prefill forward (workers/prefiller.py)


def to_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    """x / scale in E4M3, saturated (the cast itself turns values past 448 into NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (FP8 [N, K], float32 scale [N]): each row to its own absolute maximum."""
    scale = w.float().abs().amax(dim=1).div_(FP8_MAX).clamp_(min=MIN_SCALE)
    return to_fp8(w, scale.unsqueeze(1)), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 scale [M, 1]): dynamic per-token scales."""
    scale = x.float().abs().amax(dim=1, keepdim=True).div_(FP8_MAX).clamp_(min=MIN_SCALE)
    return to_fp8(x, scale), scale


@functools.cache
def scaled_mm_available(device: torch.device) -> bool:
    """FP8 tensor cores and torch._scaled_mm, unless EAGLESERVE_FP8_GEMM=0 (the fallback, for
    A/B runs)."""
    if device.type != "cuda" or os.environ.get("EAGLESERVE_FP8_GEMM") == "0":
        return False
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def weight_only_kernel_available(device: torch.device) -> bool:
    """Triton, and a GPU whose Triton widens E4M3 (compute capability 8.9: Ada, Hopper)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@contextlib.contextmanager
def prefill_forward():
    """Within it, FP8 layers quantize their activations per token (FP8 tensor cores, for the
    compute-bound GEMMs of prompts)."""
    global _in_prefill
    _in_prefill = True
    try:
        yield
    finally:
        _in_prefill = False


def uses_weight_only(device: torch.device) -> bool:
    """Weight-only outside prefill: the Triton kernel on CUDA, its float32 reference elsewhere (so
    a CPU run takes the GPU's numerics for every step). EAGLESERVE_FP8_WEIGHT_ONLY=0 quantizes the
    activations in every forward (for A/B runs)."""
    if _in_prefill or os.environ.get("EAGLESERVE_FP8_WEIGHT_ONLY") == "0":
        return False
    return device.type != "cuda" or weight_only_kernel_available(device)


def weight_only_product(x, weight, scale, bias) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] FP8 x scale [N]).T + bias, x unquantized, in x's dtype."""
    if x.device.type == "cuda":  # Triton: a GPU install's package, not every CPU one's
        from workers.layers.fp8_weight_only import weight_only_product as kernel

        return kernel(x, weight, scale, bias, num_sms(x.device))
    out = F.linear(x.float(), weight.float()).mul_(scale)
    return (out if bias is None else out.add_(bias.float())).to(x.dtype)


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Row-wise scaled FP8 GEMMs take bfloat16 outputs and dimensions in multiples of 16."""
    N, K = weight.shape
    return (
        x.dtype == torch.bfloat16 and N % 16 == 0 and K % 16 == 0 and scaled_mm_available(x.device)
    )


def scaled_mm_product(x8, x_scale, weight, scale, dtype: torch.dtype) -> torch.Tensor:
    """[M, N] in dtype (bfloat16) from FP8 x8 [M, K] and weight [N, K], on FP8 tensor cores.
    weight.t() is the column-major [K, N] operand cuBLAS wants; row-wise scales are float32
    [M, 1] and [1, N]."""
    return torch._scaled_mm(
        x8.contiguous(), weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=dtype
    )


def widened_product(x8, x_scale, weight, scale, dtype: torch.dtype) -> torch.Tensor:
    """The same product without FP8 GEMMs: products of E4M3 values are exact in float32 (on
    CPU); on a GPU the model's dtype keeps the widened weights' bytes down (its GEMMs
    accumulate in float32 too)."""
    wide = torch.float32 if x8.device.type == "cpu" else dtype
    return F.linear(x8.to(wide), weight.to(wide)).mul_(x_scale).mul_(scale).to(dtype)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] FP8 x scale [N]).T + bias, in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if uses_weight_only(x.device):
        return weight_only_product(rows, weight, scale, bias).view(*x.shape[:-1], -1)
    x8, x_scale = quantize_per_token(rows)  # [M, K], [M, 1]
    product = scaled_mm_product if uses_scaled_mm(x, weight) else widened_product
    out = product(x8, x_scale, weight, scale, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def keeps_dtype(name: str, t: torch.Tensor) -> bool:
    """FP8 weights and their float32 scales keep their dtype when a model is cast."""
    return t.dtype == FP8 or name.endswith("_scale")


def cast_(model: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """model.to(device, dtype), but for FP8 weights and their scales (which `to` would widen
    to dtype, or round)."""
    model.to(device)
    for module in model.modules():
        own = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        for name, t in own:
            if t.is_floating_point() and not keeps_dtype(name, t):
                t.data = t.data.to(dtype)
