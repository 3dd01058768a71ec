"""A mixture-of-experts FFN in two Triton launches, and the loop over experts it must equal.

Each token goes to its top-k experts: T tokens make T*k (token, expert) entries. The entries are
grouped by expert (`align_by_expert`) into blocks of BLOCK_M rows, each block one expert's, its
tail padded with a sentinel; a program multiplies one block's rows by one BLOCK_N tile of that
expert's weights (a grouped GEMM: every expert's weights read once per block, none for an expert
no token chose). The first GEMM takes the token's row of x for each entry and writes the entry's
gate and up projections; SiLU(gate) * up is one elementwise op; the second GEMM scales each
entry's down projection by its routing weight, and the k entries of a token are summed. Nothing
reads a count back to the host: every shape depends on T, k and the expert count only, so the
layer captures in CUDA graphs. FP8 expert weights (a float32 scale per expert and output row) are
widened in registers against the activations, as workers/layers/fp8_weight_only.py does."""

import torch
import triton
import triton.language as tl

from workers.layers.activation import swiglu


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, route_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    N, K, num_entries, stride_am, stride_we, stride_wn, stride_om,
    NUM_EXPERTS: tl.constexpr, A_ROWS_PER_ENTRY: tl.constexpr, HAS_SCALE: tl.constexpr,
    MUL_ROUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < NUM_EXPERTS:  # blocks past the last expert's are empty
        entries = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_ok = entries < num_entries  # the padding's sentinel is num_entries
        rows = entries // A_ROWS_PER_ENTRY  # the first GEMM reads the entry's token row
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            a_at = a_ptr + rows[:, None] * stride_am + rk[None, :]
            a = tl.load(a_at, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_at = w_base + rn[:, None] * stride_wn + rk[None, :]
            w = tl.load(w_at, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(a.dtype)
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + expert * N + rn, mask=n_ok, other=0.0)[None, :]
        if MUL_ROUTE:
            acc *= tl.load(route_ptr + entries, mask=m_ok, other=0.0)[:, None]
        out_at = out_ptr + entries[:, None] * stride_om + rn[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted [P] entry ids grouped by expert, each expert's run padded to a
    multiple of block_m with the sentinel T*k; block_expert [P / block_m], the expert of each
    block, num_experts past the last). P is the most padding can take, so nothing is synced."""
    flat = topk_ids.flatten()
    n = flat.numel()
    max_blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    order = torch.sort(flat, stable=True).indices  # entries of expert 0, then 1, ...
    experts = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int64, device=flat.device)
    sorted_ids.scatter_(0, padded_starts[experts] + rank, order)
    block_starts = torch.arange(max_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_ids, block_expert


def block_config(K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): fixed rows a block whatever the batch
    (a token's sums must not depend on the tokens beside it), deeper K tiles for wide inputs."""
    return 16, 64, 64 if K <= 1024 else 128, 4, 3


def _expert_gemm(a, w, scale, route, out, aligned, a_rows_per_entry: int, config):
    sorted_ids, block_expert = aligned
    E, N, K = w.shape
    block_m, block_n, block_k, warps, stages = config or block_config(K)
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _expert_gemm_kernel[grid](
        a, w, scale if scale is not None else w, route if route is not None else a, out,
        sorted_ids, block_expert, N, K, out.shape[0], a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), NUM_EXPERTS=E, A_ROWS_PER_ENTRY=a_rows_per_entry,
        HAS_SCALE=scale is not None, MUL_ROUTE=route is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def fused_moe(
    x, w13, w2, route_weights, topk_ids, w13_scale=None, w2_scale=None, b13=None, limit=None,
    configs=None,
):  # fmt: skip
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], in x's dtype or FP8
    with scales [E, 2I] and [E, H]; route_weights, topk_ids [T, k] -> [T, H] in x's dtype.
    b13 [E, 2I] and limit: as moe.moe_reference's. `configs`: block_config's tuples for the two
    GEMMs, to measure others (benchmarks/gpu); both must share BLOCK_M, the alignment's."""
    T, k = topk_ids.shape
    inter = w2.shape[2]
    first, second = configs or (block_config(w13.shape[2]), block_config(inter))
    aligned = align_by_expert(topk_ids, w13.shape[0], first[0])
    gate_up = x.new_empty(T * k, 2 * inter)
    x = x.contiguous()
    _expert_gemm(x, w13, w13_scale, None, gate_up, aligned, k, first)
    if b13 is not None:  # each entry's expert's
        gate_up += b13[topk_ids.flatten()]
    act = swiglu(gate_up, limit)
    down = torch.empty(T * k, x.shape[1], device=x.device, dtype=torch.float32)
    route = route_weights.float().contiguous().flatten()
    _expert_gemm(act, w2, w2_scale, route, down, aligned, 1, second)
    return down.view(T, k, -1).sum(1).to(x.dtype)
