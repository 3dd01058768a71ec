"""Attention straight over the paged KV pool, in Triton: each program takes one query token of
one row and one KV head with the query heads of its GQA group, walks the row's block table and
keeps an online softmax, so no dense copy of a request's K/V is gathered (the reference path in
workers/attention.py gathers the blocks and runs SDPA; tests compare the two under
TRITON_INTERPRET=1).

Masks, as the reference's: a chain token at position p sees keys 0..p (causal within the row,
whatever the number of query tokens); a draft-tree node t sees the keys before the row's root
(write_positions[:, 0]) and the nodes tree[t] marks."""

import torch
import triton
import triton.language as tl

from workers.kv_cache import ForwardBatch


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, pos_ptr, root_ptr, tree_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_ob, stride_ot, stride_oh,
    stride_table, num_table_blocks, T, scale,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
    BS: tl.constexpr, HAS_TREE: tl.constexpr,
):  # fmt: skip
    b, t, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g, d, s = tl.arange(0, GROUP_P2), tl.arange(0, D_P2), tl.arange(0, BS)
    g_ok, d_ok = g < GROUP, d < D
    heads = kv_head * GROUP + g
    q_at = q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_at, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G, D]
    pos = tl.load(pos_ptr + b * T + t)
    root = 0
    if HAS_TREE:
        root = tl.load(root_ptr + b)
        end = root + T
    else:
        end = pos + 1
    num_blocks = tl.minimum(tl.cdiv(end, BS), num_table_blocks)
    m = tl.full([GROUP_P2], -1e30, tl.float32)  # running max
    total = tl.zeros([GROUP_P2], tl.float32)  # running sum of exp
    acc = tl.zeros([GROUP_P2, D_P2], tl.float32)
    for i in range(0, num_blocks):
        block = tl.load(table_ptr + b * stride_table + i)
        kv_at = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_at, mask=d_ok[None, :], other=0.0).to(tl.float32)  # [BS, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BS]
        key = i * BS + s
        if HAS_TREE:
            node = key - root
            in_tree = (node >= 0) & (node < T)
            sees = tl.load(tree_ptr + t * T + node, mask=in_tree, other=0) != 0
            visible = (node < 0) | sees
        else:
            visible = key <= pos
        scores = tl.where(visible[None, :], scores, -1e30)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.where(visible[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + kv_at, mask=d_ok[None, :], other=0.0).to(tl.float32)  # [BS, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        total = total * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / total[:, None]
    out_at = out_ptr + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """q [B, T, H, D] (rotated), one layer's pool [2, blocks + 1, block_size, kv_heads, D]
    -> the attention output [B, T, H, D], under the batch's chain or tree mask."""
    B, T, H, D = q.shape
    k_pool, v_pool = pool[0], pool[1]
    kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    out = torch.empty_like(q)
    positions = batch.positions.contiguous()
    table = batch.block_table.contiguous()
    has_tree = batch.tree is not None
    root = batch.write_positions[:, 0].contiguous() if has_tree else positions
    tree = batch.tree.to(torch.int8).contiguous() if has_tree else positions
    group = H // kv_heads
    _paged_attention_kernel[(B, T, kv_heads)](
        q, k_pool, v_pool, out, table, positions, root, tree,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        table.stride(0), table.shape[1], T, D**-0.5,
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=D,
        D_P2=triton.next_power_of_2(D), BS=block_size, HAS_TREE=has_tree,
    )  # fmt: skip
    return out
