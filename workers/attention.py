"""Attention over a preallocated per-slot KV cache, shared by the target and the drafter.

Cache layout per layer: [num_slots + 1, max_len, kv_heads, head_dim]; the last slot is a dummy
that padding tokens write into. A token at position p is written at row p of its slot, so a
rejected draft costs nothing: its row is simply overwritten by the next token at p.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers import ColumnParallelLinear, Rotary, RowParallelLinear, tp_rank_size


@dataclass
class ForwardBatch:
    """Per-forward metadata (device tensors, except kv_len). B rows, T tokens per row."""
    slots: torch.Tensor            # [B] cache slot of each row
    positions: torch.Tensor        # [B, T] position of each token (pads: any valid position)
    write_slots: torch.Tensor      # [B, T] slot to write K/V into (pads: the dummy slot)
    write_positions: torch.Tensor  # [B, T] row to write into, clamped to the cache length
    kv_len: int                    # cache rows read per slot (>= every position + 1)


def allocate_kv_cache(num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device) -> torch.Tensor:
    # [layers, 2 (k, v), slots + dummy, max_len, kv_heads, head_dim]
    return torch.zeros(num_layers, 2, num_slots + 1, max_len, kv_heads, head_dim, dtype=dtype, device=device)


class CachedAttention(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: Rotary, group=None):
        super().__init__()
        _, tp = tp_rank_size(group)
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide the attention heads "
                             f"({num_heads} query, {num_kv_heads} key/value)")
        self.heads, self.kv_heads, self.head_dim = num_heads // tp, num_kv_heads // tp, head_dim
        self.qkv_proj = ColumnParallelLinear(
            in_features, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], group)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, group)
        self.rotary = rotary
        self.cache: torch.Tensor | None = None  # [2, slots + 1, max_len, kv_heads, head_dim]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = self.rotary(q.view(B, T, self.heads, self.head_dim), batch.positions)
        k = self.rotary(k.view(B, T, self.kv_heads, self.head_dim), batch.positions)
        v = v.view(B, T, self.kv_heads, self.head_dim)
        self.cache[0].index_put_((batch.write_slots, batch.write_positions), k)
        self.cache[1].index_put_((batch.write_slots, batch.write_positions), v)
        keys = self.cache[0][batch.slots, :batch.kv_len].transpose(1, 2)    # [B, kv_heads, S, D]
        values = self.cache[1][batch.slots, :batch.kv_len].transpose(1, 2)
        key_pos = torch.arange(batch.kv_len, device=x.device)
        mask = (key_pos.view(1, 1, -1) <= batch.positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, S]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
