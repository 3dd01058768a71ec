"""The paged KV pool's blocks on the host: allocation, reference counts, and the prefix cache.

A plain state machine beside the scheduler; the workers only see its decisions, as block-table
entries in the step plan. A block is either referenced (by one or more requests) or free. Free
blocks sit in least-recently-freed order; a free block may still hold a cached full block of some
request's tokens, found again by the hash chain (parent hash, the block's tokens) until the block
is taken for something else."""

from collections import OrderedDict
from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    """Allocation with no free block: the scheduler checks `num_free` first, so a bug."""


@dataclass
class PrefixStats:
    num_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_hit_tokens: int = 0  # of which found cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs blocks: {num_blocks} blocks of {block_size} tokens")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_of: dict[int, int] = {}  # block -> its hash, for cached full blocks
        self.block_of: dict[int, int] = {}  # hash -> block
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its tokens (confirms a match)
        self.stats = PrefixStats()

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """The fraction of blocks referenced by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        """A free block, the least recently freed first (dropping its cached content)."""
        if not self.free:
            raise OutOfBlocks("no free KV block")
        block, _ = self.free.popitem(last=False)
        self._uncache(block)
        self.ref_counts[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the last ones freed first leave the cache last, so
        a prefix outlives its tails."""
        for block in reversed(blocks):
            assert self.ref_counts[block] > 0, f"block {block} released twice"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    # ---- prefix cache ----

    def _uncache(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]
            del self.tokens_of[block]

    def _chunk(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.block_size : (i + 1) * self.block_size])

    def match(self, tokens: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """The cached blocks holding a prefix of `tokens`, whole blocks only and at most
        `max_tokens` tokens, each now referenced once more. -> (blocks, their hashes)."""
        if not self.enable_prefix_caching:
            return [], []
        blocks, hashes, parent = [], [], None
        for i in range(max_tokens // self.block_size):
            chunk = self._chunk(tokens, i)
            h = hash((parent, chunk))
            block = self.block_of.get(h)
            if block is None or self.tokens_of[block] != chunk:  # a miss, or a hash collision
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def cache(self, blocks: list[int], hashes: list[int], tokens: list[int]) -> None:
        """Enter the request's full blocks of computed `tokens` past those already hashed
        (`hashes`, extended in place) into the cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(len(tokens) // self.block_size, len(blocks))
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            block, chunk = blocks[i], self._chunk(tokens, i)
            h = hash((parent, chunk))
            hashes.append(h)
            parent = h
            if h not in self.block_of and block not in self.hash_of:
                self.block_of[h], self.hash_of[block], self.tokens_of[block] = block, h, chunk
