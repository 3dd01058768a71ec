"""Which attention kernel runs a shape: on CUDA the Triton kernels over the paged pool
(workers/layers/paged_attention.py for short query rows, paged_prefill.py for longer ones),
otherwise the gather + SDPA of workers/layers/attention.py, with cuDNN's GQA kernel where it is
faster than folding the query heads. Callers read these through
the module (`attention_backend.use_paged_kernel(...)`), so one switch turns a path on or off."""

import functools
import os

import torch

# query tokens a row up to which paged_attention.py's kernel runs (decode, verify, draft steps
# and short prefill chunks); past it paged_prefill.py's flash-attention tiles run, as the decode
# kernel's small query tiles lose to flash attention on long rows (at 512 it took 1.25x the
# gather's time on an H100: benchmarks/results/2026-12-06-h100/). A graph bucket boundary, so a
# padded bucket and the eager step it stands for take the same kernel
KERNEL_MAX_QUERY = 128


@functools.cache
def paged_kernel_available(device: torch.device) -> bool:
    """On CUDA with Triton, unless EAGLESERVE_PAGED_ATTENTION=0 (the gather always, for A/B)."""
    if device.type != "cuda" or os.environ.get("EAGLESERVE_PAGED_ATTENTION") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_paged_kernel(device: torch.device, query_len: int) -> bool:
    """A Triton kernel over the block table: paged_attention.py's for rows of up to
    KERNEL_MAX_QUERY tokens, paged_prefill.py's past it (unless EAGLESERVE_PAGED_PREFILL=0, for
    A/B: those gather); otherwise the reference: gather the blocks, then SDPA."""
    if not paged_kernel_available(device):
        return False
    return query_len <= KERNEL_MAX_QUERY or os.environ.get("EAGLESERVE_PAGED_PREFILL") != "0"


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_gqa(
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int,
    tokens: int,
    heads: int,
    head_dim: int,
) -> bool:
    """Whether cuDNN's GQA attention runs this shape, and faster than folding (measured on
    an H200: BENCHMARKS.md, answered questions).
    Anything cuDNN cannot run would fall back to the math kernel, many times slower: fold instead.
    EAGLESERVE_GQA=0 always folds (for A/B runs)."""
    if (
        device.type != "cuda"
        or dtype not in (torch.bfloat16, torch.float16)
        or head_dim > 128
        or head_dim % 8
        or not torch.backends.cuda.cudnn_sdp_enabled()
        or os.environ.get("EAGLESERVE_GQA") == "0"
    ):
        return False
    return tokens == 1 or tokens >= 64 or batch_size * heads <= num_sms(device)
