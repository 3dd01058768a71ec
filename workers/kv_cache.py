"""KV caches of the target and the drafter: sizing, allocation, and addressing their rows.

Layout per layer: [2 (k, v), num_slots + 1, cache_len, kv_heads, head_dim]; the last slot is a
dummy that padding tokens write into. A token at position p is written at row p of its slot, so
a rejected draft costs nothing: its row is simply overwritten by the next token at p."""

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    """Per-forward metadata (device tensors, except kv_len). B rows, T tokens per row."""

    slots: torch.Tensor  # [B] cache slot of each row
    positions: torch.Tensor  # [B, T] position of each token (pads: any valid position)
    write_slots: torch.Tensor  # [B, T] slot to write K/V into (pads: the dummy slot)
    write_positions: torch.Tensor  # [B, T] row to write into, clamped to the cache length
    kv_len: int  # cache rows read per slot (>= every position + 1)
    # a draft tree (speculative/draft_tree.py): token i of a row is node i, written at row
    # write_positions[:, 0] + i, and sees the cache before the root and the nodes tree[i] marks
    tree: torch.Tensor | None = None  # [T, T] bool


@dataclass(frozen=True)
class KVShape:
    """One model's KV rows: layers x kv heads (this rank's share) x head dim."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_cfg, tp: int, num_layers: int) -> "KVShape":
        return cls(num_layers, model_cfg.num_key_value_heads // tp, model_cfg.head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype.itemsize


def allocate_kv_cache(
    num_layers: int,
    num_slots: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
) -> torch.Tensor:
    # [layers, 2 (k, v), slots + dummy, max_len, kv_heads, head_dim]
    shape = (num_layers, 2, num_slots + 1, max_len, kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def slots_that_fit(max_batch_size: int, budget_gb: float | None, per_slot_bytes: int) -> int:
    """Request slots: max_batch_size, fewer where the memory budget holds fewer caches."""
    if budget_gb is None:
        return max_batch_size
    fits = int(budget_gb * 2**30 // per_slot_bytes)
    if fits < 1:
        raise ValueError(
            f"memory_budget_gb={budget_gb} holds no request slot "
            f"({per_slot_bytes / 2**20:.1f} MiB of KV cache per slot)"
        )
    return min(max_batch_size, fits)


def write_kv(cache: torch.Tensor, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [B, T, kv_heads, D] into one layer's cache at the batch's write rows."""
    where = (batch.write_slots, batch.write_positions)
    cache[0].index_put_(where, k)
    cache[1].index_put_(where, v)


def read_kv(cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The rows a batch reads from one layer's cache: [2, B, kv_heads, kv_len, D]."""
    return cache[:, batch.slots, : batch.kv_len].transpose(2, 3)


class KVCache:
    """The target's KV cache and the drafter's (one layer), slot by slot, with the dummy slot."""

    def __init__(
        self,
        target: KVShape,
        drafter: KVShape | None,
        num_slots: int,
        cache_len: int,
        dtype: torch.dtype,
        device,
    ):
        self.num_slots, self.cache_len = num_slots, cache_len
        self.dummy_slot = num_slots  # padding rows of a batch write here
        self.device = device

        def allocate(shape: KVShape) -> torch.Tensor:
            return allocate_kv_cache(
                shape.num_layers, num_slots, cache_len, shape.kv_heads, shape.head_dim,
                dtype, device,
            )  # fmt: skip

        self.target = allocate(target)
        self.drafter = allocate(drafter) if drafter is not None else None

    @classmethod
    def for_models(cls, target, drafter, tp: int, cfg, cache_len: int, dtype, device):
        """Caches for a rank's target and drafter (or None), as many slots as `cfg` allows."""
        target_kv = KVShape.of(target.cfg, tp, target.cfg.num_hidden_layers)
        drafter_kv = KVShape.of(drafter.cfg, tp, 1) if drafter is not None else None
        per_token = sum(s.bytes_per_token(dtype) for s in (target_kv, drafter_kv) if s)
        per_slot = per_token * cache_len
        num_slots = slots_that_fit(cfg.max_batch_size, cfg.memory_budget_gb, per_slot)
        kv = cls(target_kv, drafter_kv, num_slots, cache_len, dtype, device)
        kv.bind(target.attention_modules(), drafter.midlayer.self_attn if drafter else None)
        return kv

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.drafter.nbytes if self.drafter is not None else 0)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank, target and drafter together."""
        return self.nbytes // ((self.num_slots + 1) * self.cache_len)

    def capacity(self, max_model_len: int) -> str:
        """What vLLM users look for at start: KV per token, tokens that fit, concurrency."""
        return (
            f"KV cache {self.bytes_per_token} bytes per token; {self.num_slots * self.cache_len} "
            f"tokens of KV fit ({self.num_slots} slots x {self.cache_len}); maximum concurrency "
            f"{self.num_slots} requests at max_model_len {max_model_len}"
        )

    def bind(self, target_attention: list, drafter_attention=None) -> None:
        """Hand each attention module its layer's cache."""
        for attn, cache in zip(target_attention, self.target, strict=True):
            attn.cache = cache
        if drafter_attention is not None:
            drafter_attention.cache = self.drafter[0]

    def batch(self, slots, positions, valid, kv_len, rows=None, tree=None) -> ForwardBatch:
        """slots [B], positions and valid [B, T] -> a ForwardBatch; rows [B, T]: where to write
        each token's K/V (default: at its position); invalid tokens write to the dummy slot."""
        # rows read per slot: a multiple of 16 (the memory-efficient attention kernel's mask
        # alignment), within the cache
        kv_len = min(-(-kv_len // 16) * 16, self.cache_len)
        write_slots = torch.where(valid, slots.unsqueeze(1), self.dummy_slot)
        positions = positions.clamp(max=self.cache_len - 1)
        rows = positions if rows is None else rows.clamp(max=self.cache_len - 1)
        return ForwardBatch(slots, positions, write_slots, rows, kv_len, tree)

    def move_target_rows(self, slots, into_slots, from_rows, to_rows) -> None:
        """In every target layer, row from_rows [B] of each slot to row to_rows [B] of
        into_slots [B] (the dummy slot where nothing should move)."""
        end = self.cache_len - 1
        source = self.target[:, :, slots, from_rows.clamp(max=end)]
        self.target[:, :, into_slots, to_rows.clamp(max=end)] = source
