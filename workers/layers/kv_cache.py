"""KV caches of the target and the drafter: a paged pool of fixed-size blocks (sized by
workers/kv_sizing.py), and addressing their rows.

Layout per layer: [2 (k, v), num_blocks + 1, block_size, kv_heads, head_dim]; the last block is a
dummy that padding tokens (and rows past a request's blocks) write into. block_table[slot, i] is
the block holding positions i * block_size.. of the request in that slot; the scheduler's block
manager (speculative/engine/) decides it and each plan carries the changes. A token at
position p is written at row p of its request, so a rejected draft costs nothing: its row is
simply overwritten by the next token at p. Without block updates in the plans (plans built by
hand), slot s owns blocks s * max_blocks.. as a contiguous per-slot cache.

An FP8 pool (kv_cache_dtype fp8) holds E4M3 rows, each layer's K and V divided by its own scale
(the checkpoint's, else 1.0, as vLLM's default is): half the bytes of bfloat16, twice the
tokens."""

import logging
from dataclasses import dataclass

import torch

from workers.layers.fp8 import FP8, to_fp8

log = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    """Per-forward metadata (device tensors, except kv_len). B rows, T tokens per row."""

    slots: torch.Tensor  # [B] request slot of each row
    positions: torch.Tensor  # [B, T] position of each token (pads: any valid position)
    write_positions: torch.Tensor  # [B, T] row of its request each token's K/V goes to
    write_blocks: torch.Tensor  # [B, T] the block it is in (pads: the dummy block)
    write_offsets: torch.Tensor  # [B, T] the row within that block
    block_table: torch.Tensor  # [B, kv_len // block_size] blocks each row reads
    kv_len: int  # rows read per request (>= every position + 1)
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


def allocate_pool(
    shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device
) -> torch.Tensor:
    # [layers, 2 (k, v), blocks + dummy, block_size, kv_heads, head_dim]
    size = (shape.num_layers, 2, num_blocks + 1, block_size, shape.kv_heads, shape.head_dim)
    return torch.zeros(size, dtype=dtype, device=device)


def kv_shapes(target, drafter, tp: int) -> tuple[KVShape, KVShape | None]:
    """A rank's KV rows: the target's layers, and the drafter's one layer (or None)."""
    target_kv = KVShape.of(target.cfg, tp, target.cfg.num_hidden_layers)
    return target_kv, KVShape.of(drafter.cfg, tp, 1) if drafter is not None else None


def bytes_per_token(shapes, dtype: torch.dtype) -> int:
    return sum(s.bytes_per_token(dtype) for s in shapes if s is not None)


def write_kv(
    pool: torch.Tensor, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor, scale=(1.0, 1.0)
) -> None:
    """k, v [B, T, kv_heads, D] into one layer's pool at the batch's write rows (an FP8 pool:
    divided by the layer's scale (k, v) first)."""
    where = (batch.write_blocks, batch.write_offsets)
    if pool.dtype == FP8:
        k, v = to_fp8(k, scale[0]), to_fp8(v, scale[1])
    pool[0].index_put_(where, k)
    pool[1].index_put_(where, v)


def read_kv(
    pool: torch.Tensor, batch: ForwardBatch, scale=(1.0, 1.0), dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The rows a batch reads from one layer's pool, its blocks gathered in order:
    [2, B, kv_heads, kv_len, D] (an FP8 pool's in `dtype`, times the layer's scale (k, v))."""
    blocks = pool[:, batch.block_table]  # [2, B, kv_len // bs, bs, kv_heads, D]
    two, B, n, bs, kv_heads, D = blocks.shape
    kv = blocks.view(two, B, n * bs, kv_heads, D).transpose(2, 3)
    if pool.dtype != FP8:
        return kv
    kv = kv.to(dtype)
    for i in (0, 1):
        if scale[i] != 1.0:
            kv[i].mul_(scale[i])
    return kv


class KVCache:
    """The target's KV pool and the drafter's (one layer) behind one block table, with the dummy
    slot (whose blocks are all the dummy block) and the dummy block."""

    def __init__(self, target: KVShape, drafter: KVShape | None, num_slots: int, cache_len: int,
                 num_blocks: int, block_size: int, dtype: torch.dtype, device):  # fmt: skip
        if block_size % 16:
            raise ValueError(f"kv_block_size ({block_size}) must be a multiple of 16")
        self.num_slots, self.block_size, self.num_blocks = num_slots, block_size, num_blocks
        self.max_blocks = -(-cache_len // block_size)  # per request
        self.cache_len = self.max_blocks * block_size
        self.dummy_slot, self.dummy_block = num_slots, num_blocks
        self.device = device
        self.sized_by = ""  # the rule that sized the pool (workers/kv_sizing.py), for the log
        self.target = allocate_pool(target, num_blocks, block_size, dtype, device)
        self.drafter = None
        if drafter is not None:
            self.drafter = allocate_pool(drafter, num_blocks, block_size, dtype, device)
        # [slots + 1, max_blocks]; the contiguous per-slot layout where the pool holds it
        self.block_table = torch.full(
            (num_slots + 1, self.max_blocks), self.dummy_block, dtype=torch.long, device=device
        )
        if num_blocks >= num_slots * self.max_blocks:
            contiguous = torch.arange(num_slots * self.max_blocks, device=device)
            self.block_table[:num_slots] = contiguous.view(num_slots, self.max_blocks)

    @classmethod
    def for_models(cls, target, drafter, tp: int, size, cache_len: int, dtype, device):
        """Pools for a rank's target and drafter (or None), as big as `size` (a PoolSize of
        workers/kv_sizing.py) says, bound to their attention modules."""
        shapes, bs = kv_shapes(target, drafter, tp), size.block_size
        kv = cls(*shapes, size.num_slots, cache_len, size.num_blocks, bs, dtype, device)
        kv.sized_by = size.rule
        kv.bind(target.attention_modules(), drafter.midlayer.self_attn if drafter else None)
        return kv

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.drafter.nbytes if self.drafter is not None else 0)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank, target and drafter together."""
        return self.nbytes // ((self.num_blocks + 1) * self.block_size)

    def capacity(self, max_model_len: int) -> str:
        """What vLLM users look for at start: KV per token, tokens that fit, concurrency."""
        tokens = self.num_blocks * self.block_size
        return (
            f"KV cache {self.bytes_per_token} bytes per token; {self.num_blocks} blocks of "
            f"{self.block_size} = {tokens} tokens of KV fit ({self.nbytes / 2**20:.1f} MiB, "
            f"target and drafter; sized by {self.sized_by or 'hand'}); maximum concurrency "
            f"{tokens / max_model_len:.2f} requests at max_model_len {max_model_len} "
            f"({self.num_slots} request slots)"
        )

    def bind(self, target_attention: list, drafter_attention=None) -> None:
        """Hand each attention module its layer's pool."""
        if self.target.dtype == FP8 and all(a.kv_scale == [1.0, 1.0] for a in target_attention):
            log.warning(  # as vLLM warns: E4M3 rows of K and V as they are, from -448 to 448
                "FP8 KV cache with scales of 1.0 (the checkpoint has no k_scale / v_scale)"
            )
        for attn, pool in zip(target_attention, self.target, strict=True):
            attn.cache = pool
        if drafter_attention is not None:
            drafter_attention.cache = self.drafter[0]

    def update_tables(self, new_slots, where, blocks) -> None:
        """Before a step: the rows of newly admitted slots new_slots [N] reset to the dummy
        block, then block_table[where] = blocks (where: ([U] slots, [U] indices), blocks [U])."""
        self.block_table.index_fill_(0, new_slots, self.dummy_block)
        self.block_table.index_put_(where, blocks)

    def _locate(self, slots, rows):
        """slots [B] or [B, T] (broadcast), rows [B, T] -> (block, row within it) [B, T]."""
        rows = rows.clamp(max=self.cache_len - 1)
        slots = slots.unsqueeze(1).expand_as(rows) if slots.dim() == 1 else slots
        blocks = self.block_table[slots, rows // self.block_size]
        return blocks, rows % self.block_size

    def batch(self, slots, positions, valid, kv_len, rows=None, tree=None) -> ForwardBatch:
        """slots [B], positions and valid [B, T] -> a ForwardBatch; rows [B, T]: where to write
        each token's K/V (default: at its position); invalid tokens write to the dummy block."""
        # rows read per request: whole blocks (a multiple of 16: the memory-efficient
        # attention kernel's mask alignment), within the cache
        bs = self.block_size
        kv_len = min(-(-kv_len // bs) * bs, self.cache_len)
        positions = positions.clamp(max=self.cache_len - 1)
        rows = positions if rows is None else rows.clamp(max=self.cache_len - 1)
        blocks, offsets = self._locate(slots, rows)
        blocks = torch.where(valid, blocks, self.dummy_block)
        table = self.block_table[slots, : kv_len // bs]
        return ForwardBatch(slots, positions, rows, blocks, offsets, table, kv_len, tree)

    def move_target_rows(self, slots, into_slots, from_rows, to_rows) -> None:
        """In every target layer, row from_rows [B] of each slot's request to row to_rows [B] of
        into_slots' [B] (the dummy slot where nothing should move)."""
        from_blocks, from_offsets = self._locate(slots, from_rows.unsqueeze(1))
        to_blocks, to_offsets = self._locate(into_slots, to_rows.unsqueeze(1))
        source = self.target[:, :, from_blocks[:, 0], from_offsets[:, 0]]
        self.target[:, :, to_blocks[:, 0], to_offsets[:, 0]] = source
