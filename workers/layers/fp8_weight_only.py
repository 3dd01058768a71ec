"""FP8 weights against bf16 activations for the few rows of a decode or verify step, in Triton.

At M = 1..a few hundred rows a GEMM only reads its weights, so what counts is reading each FP8
byte once: a program takes BLOCK_N output columns, walks K a tile at a time, widens the FP8
tile to the activations' dtype in registers and multiplies on tensor cores, then applies the
per-row weight scale (and the bias) to its float32 accumulator. The activations stay as they
are: no per-token quantization pass, and no FP8 rounding of them. Where the columns alone leave
the SMs idle (N = 4096 at batch 1), K is split over programs whose float32 partial sums are
added by a second pass, in a fixed order (no atomics: the same inputs give the same bits).

`torch._scaled_mm` (FP8 tensor cores, activations quantized per token) stays the path for
prefill, where the GEMM is compute-bound: workers/layers/fp8.py picks by the kind of forward."""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _fp8_weight_only_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    # SWAP: out.T = w @ x.T, the columns as the tensor cores' rows (their tiles start at 64)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x_at = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        w_at = w_ptr + rn[:, None] * stride_wn + rk[None, :]
        x = tl.load(x_at, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_at, mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        w = w.to(x.dtype)  # FP8 widened in registers
        if SWAP:
            acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    if SPLIT_K == 1:
        acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:  # partial sums [SPLIT_K, M, N] in float32, added by _sum_splits_kernel
        out = out_ptr + split * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    part_ptr, scale_ptr, bias_ptr, out_ptr, M, N,
    BLOCK: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + i, mask=ok, other=0.0)
    n = i % N
    acc *= tl.load(scale_ptr + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def block_config(M: int, N: int, K: int, num_sms: int) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, SWAP) for a shape, fitted to
    the sweep of benchmarks/gpu/fp8_weight_only_bench.py on an H100 (benchmarks/results/
    2026-12-07-h100/fp8_weight_only.json: its fastest block sizes at 8B's shapes for M = 1, 8
    and 48): rows in tiles of up to 64; for one to 16 rows narrow column tiles and 8 warps, wider
    ones past that; K split (while each split walks at least 1024 of K) until the programs would
    pass three per SM."""
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    if block_m == 16:
        block_n = 32 if triton.cdiv(N, 64) >= 2 * num_sms else 64
    else:
        block_n = 128 if 3 * triton.cdiv(N, 128) >= num_sms else 64
    programs = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    split = 1
    while split < 4 and programs * split * 2 <= 3 * num_sms and K // (split * 2) >= 1024:
        split *= 2
    block_k = 256 if block_m == 16 and K >= 8192 else 128
    warps = 8 if block_m == 16 and block_n == 64 else 4
    return block_m, block_n, block_k, split, warps, 3, False


def weight_only_product(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias, num_sms: int, config=None
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ (weight [N, K] FP8 x scale [N] float32).T + bias -> [M, N]
    in x's dtype. `config`: block_config's tuple, to measure others (benchmarks/gpu)."""
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    block_m, block_n, block_k, split, warps, stages, swap = config or block_config(M, N, K, num_sms)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    dest = out if split == 1 else torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    has_bias = bias is not None
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split)
    _fp8_weight_only_kernel[grid](
        x, weight, scale, bias if has_bias else scale, dest, M, N, K, x.stride(0),
        weight.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        HAS_BIAS=has_bias, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SWAP=swap,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](
            dest, scale, bias if has_bias else scale, out, M, N,
            BLOCK=block, SPLIT_K=split, HAS_BIAS=has_bias,
        )  # fmt: skip
    return out
