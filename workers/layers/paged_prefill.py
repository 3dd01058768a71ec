"""Causal attention for long query rows (prefill chunks of more than KERNEL_MAX_QUERY tokens)
straight over the paged KV pool, in Triton: flash attention tiled over query tiles x key tiles,
each key tile's blocks looked up in the row's block table, so a chunk past a long or
prefix-cached context reads its keys in place instead of gathering them into a dense copy (the
reference path in attention.py; tests compare the two under TRITON_INTERPRET=1).

A program takes one row, one KV head and BLOCK_M query rows: (token, query head) pairs of that
head's GQA group, as paged_attention.py's kernel does, so each K/V tile serves the whole group.
The keys before the tile's first token are visible to all its rows and run without a mask; only
the key tiles across the diagonal are masked, and none past the tile's last token is read. The
tiles of a row launch last token first: those see the most keys, and the short ones fill the
tail of the wave. Where the tiles leave SMs idle (a short chunk past a long cached prefix), a
tile's keys are split across programs, as in paged_attention.py, whose second kernel merges them.

An FP8 pool's tiles are widened to the queries' dtype as they are loaded; K's scale folds into
the softmax scale, V's into the output. gpt-oss's sliding window and sinks as paged_attention.py
takes them (with a window every key tile is masked)."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from workers.layers.kv_cache import ForwardBatch
from workers.layers.paged_attention import (
    MIN_SPLIT_KEYS,
    _combine_splits_kernel,
    add_sink,
    default_splits,
    window_start,
)

LOG2_E = 1.4426950408889634


class PrefillTiles(NamedTuple):
    block_m: int  # query rows a program: (token, query head) pairs
    block_n: int  # keys a tile
    num_warps: int
    num_stages: int  # key tiles in flight


# 16-bit queries with heads of up to 128: a 128 x 128 query tile and two stages of 64-key K and V
# tiles, about 96 KiB of shared memory; float32 or wider heads take half the rows and keys
WIDE_TILES = PrefillTiles(128, 64, 8, 2)
NARROW_TILES = PrefillTiles(64, 32, 4, 2)


def default_tiles(dtype: torch.dtype, head_dim: int) -> PrefillTiles:
    return WIDE_TILES if dtype.itemsize <= 2 and head_dim <= 128 else NARROW_TILES


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, end, pos, b, kv_head, d, d_ok, k_ptr, v_ptr, table_ptr,
    stride_table, stride_kb, stride_ks, stride_kh, scale_log2,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    """One key tile [start, start + BLOCK_N) into the online softmax (base 2)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < end
    block = tl.load(table_ptr + b * stride_table + n // BS, mask=n_ok, other=0)
    kv_at = block[:, None] * stride_kb + (n % BS)[:, None] * stride_ks + d[None, :]
    kv_at += kv_head * stride_kh
    kv_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + kv_at, mask=kv_ok, other=0.0).to(q.dtype)  # [N, D]
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N]
    if MASKED:
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, -1e30)
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    if MASKED:
        p = tl.where(visible, p, 0.0)
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(v_ptr + kv_at, mask=kv_ok, other=0.0).to(q.dtype)  # [N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


# the arguments that change from step to step stay unspecialised (see paged_attention.py)
@triton.jit(do_not_specialize=["stride_table", "num_table_blocks", "T"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, table_ptr, pos_ptr, sinks_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_ob, stride_ot, stride_oh,
    stride_table, num_table_blocks, num_kv_heads, T, num_rows, scale_log2, v_scale,
    GROUP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tokens first
    bh, split = tl.program_id(1), tl.program_id(2)
    b, kv_head = bh // num_kv_heads, bh % num_kv_heads
    r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows: (token, head of the group)
    t, head = r // GROUP, kv_head * GROUP + r % GROUP
    d = tl.arange(0, D_P2)
    row_ok, d_ok = t < T, d < D
    q_at = q_ptr + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_at, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    pos = tl.load(pos_ptr + b * T + t, mask=row_ok, other=-1)
    capacity = num_table_blocks * BS
    end = tl.minimum(tl.max(pos) + 1, capacity)
    first = window_start(pos, row_ok, end, WINDOW, BLOCK_N)
    # this program's share of the tile's keys (all of them without splits), in whole tiles
    split_len = tl.cdiv(tl.cdiv(end - first, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, MIN_SPLIT)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, end)
    # keys every row of the tile sees, in whole tiles (with a window, none is sure to be)
    unmasked_end = tl.minimum(tl.min(tl.where(row_ok, pos, capacity)) + 1, hi)
    unmasked_end = tl.maximum(unmasked_end // BLOCK_N * BLOCK_N, lo)
    if WINDOW > 0:
        unmasked_end = lo
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    for start in range(lo, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, hi, pos, b, kv_head, d, d_ok, k_ptr, v_ptr, table_ptr,
            stride_table, stride_kb, stride_ks, stride_kh, scale_log2,
            BS=BS, BLOCK_N=BLOCK_N, MASKED=False, PRECISION=PRECISION, WINDOW=WINDOW,
        )  # fmt: skip
    for start in range(unmasked_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, hi, pos, b, kv_head, d, d_ok, k_ptr, v_ptr, table_ptr,
            stride_table, stride_kb, stride_ks, stride_kh, scale_log2,
            BS=BS, BLOCK_N=BLOCK_N, MASKED=True, PRECISION=PRECISION, WINDOW=WINDOW,
        )  # fmt: skip
    acc = acc * v_scale
    if HAS_SINKS and not SPLIT:  # the running max x ln 2: in natural units, as the sinks are
        m_i, l_i, acc = add_sink(m_i * 0.6931471805599453, l_i, acc, tl.load(sinks_ptr + head))
    if SPLIT:  # an unnormalised partial (its max in natural units), as paged_attention.py's
        at = (bh * tl.num_programs(2) + split) * num_rows + r
        tl.store(m_ptr + at, m_i * 0.6931471805599453)  # x ln 2 (jit code reads no globals)
        tl.store(l_ptr + at, l_i)
        tl.store(out_ptr + at[:, None] * D_P2 + d[None, :], acc)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_at = b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        out_mask = row_ok[:, None] & d_ok[None, :]
        tl.store(out_ptr + o_at, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def paged_prefill(
    q: torch.Tensor,
    pool: torch.Tensor,
    batch: ForwardBatch,
    kv_scale=(1.0, 1.0),
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, T, H, D] (rotated), one layer's pool [2, blocks + 1, block_size, kv_heads, D]
    -> the attention output [B, T, H, D] under the chain's causal mask (a token at position p
    sees keys 0..p). kv_scale: an FP8 pool's K and V scales (ignored for others); tiles: the
    tiles and their launch (default_tiles; benchmarks compare others); num_splits: how many
    programs share a tile's keys (default: default_splits, where a short chunk past a long
    context leaves SMs idle; paged_attention.py's second kernel merges them); window and sinks
    [H]: gpt-oss's (paged_attention.py)."""
    assert batch.tree is None, "draft trees run paged_attention.py's kernel"
    B, T, H, D = q.shape
    k_pool, v_pool = pool[0], pool[1]
    kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    group = H // kv_heads
    tiles = tiles or default_tiles(q.dtype, D)
    m_tiles = triton.cdiv(T * group, tiles.block_m)
    d_p2 = max(16, triton.next_power_of_2(D))
    if num_splits is None:
        num_splits = default_splits(m_tiles * B * kv_heads, batch.kv_len, q.device)
    out = torch.empty_like(q)
    positions = batch.positions.contiguous()
    table = batch.block_table.contiguous()
    num_rows = m_tiles * tiles.block_m
    partial, m_part, l_part = out, positions, positions  # the last two unused without splits
    if num_splits > 1:
        parts = (B * kv_heads, num_splits, num_rows)
        partial = torch.empty(*parts, d_p2, dtype=torch.float32, device=q.device)
        m_part = torch.empty(parts, dtype=torch.float32, device=q.device)
        l_part = torch.empty(parts, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: unused for bf16/fp16
    k_scale, v_scale = kv_scale if pool.dtype == torch.float8_e4m3fn else (1.0, 1.0)
    sink_logits = sinks.float().contiguous() if sinks is not None else positions
    _paged_prefill_kernel[(m_tiles, B * kv_heads, num_splits)](
        q, k_pool, v_pool, partial, m_part, l_part, table, positions, sink_logits,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        table.stride(0), table.shape[1], kv_heads, T, num_rows,
        D**-0.5 * k_scale * LOG2_E, v_scale,
        GROUP=group, D=D, D_P2=d_p2, BS=block_size, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, MIN_SPLIT=MIN_SPLIT_KEYS, SPLIT=num_splits > 1,
        PRECISION=precision, WINDOW=window or 0, HAS_SINKS=sinks is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(B * kv_heads, m_tiles)](
            partial, m_part, l_part, out, sink_logits,
            out.stride(0), out.stride(1), out.stride(2),
            kv_heads, T, num_splits, num_rows,
            GROUP=group, D=D, D_P2=d_p2, BLOCK_M=tiles.block_m, HAS_SINKS=sinks is not None,
        )  # fmt: skip
    return out
