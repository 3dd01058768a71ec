"""Random paged batches for the Triton attention kernels' tests, and the reference they are held
to: the blocks gathered in order, then SDPA under the same mask (the engine's CPU path)."""

import os

import torch
import torch.nn.functional as F

from workers.layers.attention import hidden_keys
from workers.layers.kv_cache import ForwardBatch, read_kv

# TRITON_INTERPRET=1 (the test modules' default): Triton's interpreter on CPU; else CUDA
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "1") == "1" else "cuda"


def reference(
    q: torch.Tensor, pool: torch.Tensor, batch: ForwardBatch, scale=(1.0, 1.0), window=None,
    sinks=None,
):  # fmt: skip
    """window: keys that many positions back or more hidden; sinks [H]: a logit per head in
    each softmax with no value (gpt-oss), computed here the long way."""
    kv = read_kv(pool, batch, scale, q.dtype)  # [2, B, KV, S, D]
    hidden = hidden_keys(batch)
    if window is not None:
        keys = torch.arange(batch.kv_len, device=q.device)
        hidden = hidden | (keys.view(1, 1, -1) <= batch.positions.unsqueeze(-1) - window)
    bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill_(hidden, float("-inf")).unsqueeze(1)
    if sinks is None:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), kv[0], kv[1], attn_mask=bias, enable_gqa=True
        )
        return out.transpose(1, 2)
    group = q.shape[2] // kv.shape[2]
    k, v = (x.repeat_interleave(group, dim=1).float() for x in kv)  # [B, H, S, D]
    scores = q.transpose(1, 2).float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return (probs @ v).transpose(1, 2).to(q.dtype)


def random_batch(g, B, T, heads, kv_heads, D, block_size, tree=None, max_blocks=6, shared_blocks=0):
    """Rows at random lengths over randomly scattered blocks of a shared pool; T query tokens
    a row, at the row's last T positions (causal within the row). shared_blocks: every row's
    first blocks are row 0's, as the prefix cache shares a prompt's blocks."""
    num_blocks = B * max_blocks + 3
    pool = torch.randn(2, num_blocks + 1, block_size, kv_heads, D, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks)
    table[:, :shared_blocks] = table[0, :shared_blocks]
    low = T + shared_blocks * block_size  # a chunk past the shared prefix
    lens = torch.randint(low, max_blocks * block_size - T + 1, (B,), generator=g)
    base = lens - T  # [B] position of each row's first query token
    columns = torch.arange(T)
    positions = base.unsqueeze(1) + (columns if tree is None else tree[0])
    write_positions = base.unsqueeze(1) + columns
    kv_len = max_blocks * block_size
    tree_mask = None if tree is None else tree[1].to(DEVICE)
    batch = ForwardBatch(*(x.to(DEVICE) for x in (
        torch.arange(B), positions, write_positions, write_positions, write_positions, table
    )), kv_len, tree_mask)  # fmt: skip
    q = torch.randn(B, T, heads, D, generator=g)
    return q.to(DEVICE), pool.to(DEVICE), batch
