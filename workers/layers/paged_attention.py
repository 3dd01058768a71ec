"""Attention straight over the paged KV pool, in Triton, with no dense copy of a request's K/V
(the reference path in attention.py gathers the blocks and runs SDPA; tests compare the
two under TRITON_INTERPRET=1).

A program takes one row, one KV head and a tile of query rows: the (token, query head) pairs of
that head's GQA group, so each K/V tile it reads serves the whole group, and both products are
tensor-core dots. It walks the row's keys a tile of BLOCK_N at a time, each key's block looked
up in the block table, with an online softmax. Where rows x KV heads leave the GPU's SMs idle
(small batches, long contexts), the keys are split across programs (flash-decoding) and a
second kernel combines the splits' partial softmaxes.

Masks, as the reference's: a chain token at position p sees keys 0..p (causal within the row,
whatever the number of query tokens); a draft-tree node t sees the keys before the row's root
(write_positions[:, 0]) and the nodes tree[t] marks.

An FP8 pool's tiles are widened to the queries' dtype as they are loaded; K's scale folds into
the softmax scale, V's into the output.

gpt-oss: a sliding window (WINDOW > 0) hides the keys WINDOW or more positions before a token,
and the key tiles before the window of a program's first token are not read; a sink logit per
query head joins each softmax's denominator (with no value) after the keys, or in the combine
when the keys are split."""

import torch
import triton
import triton.language as tl

from workers.layers.attention_backend import num_sms
from workers.layers.kv_cache import ForwardBatch

BLOCK_N = 64  # keys per tile
MIN_SPLIT_KEYS = 128  # a split reads at least this many keys (a multiple of BLOCK_N)


# Triton compiles a variant for each integer argument that is 1, a multiple of 16 or neither:
# the arguments that change from step to step stay unspecialised, so that a new step shape does
# not meet a compile of a second or more while serving (the first eager steps past a cached
# prefix took 0.7-4 s on an H100)
@triton.jit(do_not_specialize=["stride_table", "num_table_blocks", "T"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, table_ptr, pos_ptr, root_ptr, tree_ptr,
    sinks_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_ob, stride_ot, stride_oh,
    stride_table, num_table_blocks, num_kv_heads, T, num_rows, scale, v_scale,
    GROUP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
    HAS_TREE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    bh, m_tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv_head = bh // num_kv_heads, bh % num_kv_heads
    r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows: (token, head of the group)
    t, head = r // GROUP, kv_head * GROUP + r % GROUP
    d = tl.arange(0, D_P2)
    row_ok, d_ok = t < T, d < D
    q_at = q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_at, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    pos = tl.load(pos_ptr + b * T + t, mask=row_ok, other=-1)
    if HAS_TREE:
        root = tl.load(root_ptr + b)
        end = root + T
    else:
        end = tl.max(pos) + 1
    end = tl.minimum(end, num_table_blocks * BS)
    first = window_start(pos, row_ok, end, WINDOW, BLOCK_N)
    # each row splits its own keys: a graph captured at the longest kv_len still spreads a short
    # row over its splits
    split_len = tl.cdiv(tl.cdiv(end - first, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, MIN_SPLIT)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, end)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(table_ptr + b * stride_table + n // BS, mask=n_ok, other=0)
        kv_at = block[:, None] * stride_kb + (n % BS)[:, None] * stride_ks + d[None, :]
        kv_at += kv_head * stride_kh
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_at, mask=kv_ok, other=0.0).to(q.dtype)  # [N, D]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
        if HAS_TREE:
            node = n - root
            in_tree = (node >= 0) & (node < T)
            seen = row_ok[:, None] & (in_tree & n_ok)[None, :]
            sees = tl.load(tree_ptr + t[:, None] * T + node[None, :], mask=seen, other=0) != 0
            visible = ((node < 0)[None, :] | sees) & n_ok[None, :]
        else:
            visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, -1e30)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(visible, tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + kv_at, mask=kv_ok, other=0.0).to(q.dtype)  # [N, D]
        pv = tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    acc = acc * v_scale
    if HAS_SINKS and not SPLIT:
        m_i, l_i, acc = add_sink(m_i, l_i, acc, tl.load(sinks_ptr + head))
    if SPLIT:  # this split's unnormalised partial, for _combine_splits_kernel
        at = (bh * tl.num_programs(2) + split) * num_rows + r
        tl.store(m_ptr + at, m_i)
        tl.store(l_ptr + at, l_i)
        tl.store(out_ptr + at[:, None] * D_P2 + d[None, :], acc)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_at = b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        out_mask = row_ok[:, None] & d_ok[None, :]
        tl.store(out_ptr + o_at, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def window_start(pos, row_ok, end, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first key tile a program reads: 0, or with a sliding window the tile of the first key
    its earliest token sees."""
    earliest = tl.min(tl.where(row_ok, pos, end))
    if WINDOW > 0:
        return tl.maximum(earliest - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    return earliest * 0  # one return type


@triton.jit
def add_sink(m_i, l_i, acc, sink):
    """A softmax's running max, sum and output [M, D] after the sink logits [M] joined it."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.exp(sink - m_new), acc * alpha[:, None]


@triton.jit(do_not_specialize=["T", "num_splits"])
def _combine_splits_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, sinks_ptr,
    stride_ob, stride_ot, stride_oh,
    num_kv_heads, T, num_splits, num_rows,
    GROUP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    bh, m_tile = tl.program_id(0), tl.program_id(1)
    b, kv_head = bh // num_kv_heads, bh % num_kv_heads
    r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t, head = r // GROUP, kv_head * GROUP + r % GROUP
    d = tl.arange(0, D_P2)
    m_run = tl.full([BLOCK_M], -1e30, tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink first: its own max, exp(0) in the sum, no value
        m_run = tl.load(sinks_ptr + head)
        l_run = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    for split in range(num_splits):
        at = (bh * num_splits + split) * num_rows + r
        m_s, l_s = tl.load(m_ptr + at), tl.load(l_ptr + at)
        m_new = tl.maximum(m_run, m_s)
        alpha, beta = tl.exp(m_run - m_new), tl.exp(m_s - m_new)
        acc_s = tl.load(acc_ptr + at[:, None] * D_P2 + d[None, :])
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        l_run = l_run * alpha + l_s * beta
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    o_at = b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_mask = (t < T)[:, None] & (d < D)[None, :]
    tl.store(out_ptr + o_at, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def query_tiles(T: int, group: int) -> tuple[int, int]:
    """(query rows a tile, tiles a row and KV head) for T tokens of a GQA group's heads."""
    rows = T * group
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    return block_m, triton.cdiv(rows, block_m)


def split_count(programs: int, kv_len: int, sms: int) -> int:
    """Splits of each row's keys for about two programs per SM, given `programs` (rows x KV
    heads x query tiles) and sms SMs, each split of at least MIN_SPLIT_KEYS of kv_len keys; one
    where the rows and heads fill the GPU already. kv_len is the block table's (a graph's is
    the cache's whole length): a shorter row spreads over as many splits as MIN_SPLIT_KEYS
    allows, and the rest pass empty partials to the combine."""
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, kv_len // MIN_SPLIT_KEYS))


def default_splits(programs: int, kv_len: int, device: torch.device) -> int:
    """split_count on this GPU; one on CPU."""
    if device.type != "cuda":
        return 1
    return split_count(programs, kv_len, num_sms(device))


def paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    batch: ForwardBatch,
    num_splits: int | None = None,
    kv_scale=(1.0, 1.0),
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, T, H, D] (rotated), one layer's pool [2, blocks + 1, block_size, kv_heads, D]
    -> the attention output [B, T, H, D], under the batch's chain or tree mask. num_splits:
    how many programs share a row's keys (default: default_splits); kv_scale: an FP8 pool's
    K and V scales (ignored for others); window, sinks [H]: gpt-oss's (module docstring)."""
    B, T, H, D = q.shape
    k_pool, v_pool = pool[0], pool[1]
    kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    group = H // kv_heads
    block_m, m_tiles = query_tiles(T, group)
    d_p2 = max(16, triton.next_power_of_2(D))
    if num_splits is None:
        num_splits = default_splits(B * kv_heads * m_tiles, batch.kv_len, q.device)
    out = torch.empty_like(q)
    positions = batch.positions.contiguous()
    table = batch.block_table.contiguous()
    has_tree = batch.tree is not None
    root = batch.write_positions[:, 0].contiguous() if has_tree else positions
    tree = batch.tree.to(torch.int8).contiguous() if has_tree else positions
    split = num_splits > 1
    num_rows = m_tiles * block_m
    partial = out
    m_part = l_part = positions  # unused without splits
    if split:
        parts = (B * kv_heads, num_splits, num_rows)
        partial = torch.empty(*parts, d_p2, dtype=torch.float32, device=q.device)
        m_part = torch.empty(parts, dtype=torch.float32, device=q.device)
        l_part = torch.empty(parts, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: unused for bf16/fp16
    k_scale, v_scale = kv_scale if pool.dtype == torch.float8_e4m3fn else (1.0, 1.0)
    sink_logits = sinks.float().contiguous() if sinks is not None else positions
    _paged_attention_kernel[(B * kv_heads, m_tiles, num_splits)](
        q, k_pool, v_pool, partial, m_part, l_part, table, positions, root, tree, sink_logits,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        table.stride(0), table.shape[1], kv_heads, T, num_rows, D**-0.5 * k_scale, v_scale,
        GROUP=group, D=D, D_P2=d_p2, BS=block_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        MIN_SPLIT=MIN_SPLIT_KEYS, HAS_TREE=has_tree, SPLIT=split, PRECISION=precision,
        WINDOW=window or 0, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    if split:
        _combine_splits_kernel[(B * kv_heads, m_tiles)](
            partial, m_part, l_part, out, sink_logits,
            out.stride(0), out.stride(1), out.stride(2),
            kv_heads, T, num_splits, num_rows,
            GROUP=group, D=D, D_P2=d_p2, BLOCK_M=block_m, HAS_SINKS=sinks is not None,
        )  # fmt: skip
    return out
