"""The paged KV pool's size: its request slots, its blocks, and the rule that chose them. Pure
arithmetic; workers/memory_profile.py measures the GPU for it.

- Request slots: `max_batch_size`, or where it is not set `default_slots` (vLLM's 256 on CUDA, 8
  on CPU, no more than one step's budget verifies, nor than the pool holds requests).

- `kv_cache_memory_gb`, when set, always wins: the blocks it holds (at least one).
- On CUDA without it, as vLLM sizes it: `gpu_memory_utilization` x the GPU's memory is this
  engine's, and the pool gets what the weights, a profiled peak step and the CUDA graphs leave of
  it (`gpu_blocks`).
- On CPU there is no device memory to measure: every slot at full length, at most
  CPU_KV_CACHE_GB.
A pool sized by either default must hold one request at max_model_len, else start fails naming
the numbers (as vLLM's does): requests are only checked against max_model_len at the door."""

from dataclasses import dataclass

from workers.layers.kv_cache import KVShape

# vLLM's CPU default is 4 GiB (VLLM_CPU_KVCACHE_SPACE). Ours is 1 GiB: SmolLM2 in fp32 takes
# 46.5 KiB a token, so 1 GiB holds 22544 tokens, 2.7 requests at its 8192 positions (8 slots at
# full length would be 3 GiB), and the test suite starts many engines at once on a 24 GB machine.
# Smaller contexts (max_model_len) are not capped: every slot at full length fits.
CPU_KV_CACHE_GB = 1.0
GiB = 2**30
# request slots where max_batch_size is not set: vLLM's max_num_seqs default on a GPU (recent vLLM
# takes 1024 on cards of 70 GiB or more; 256 keeps the graphs to BATCH_BUCKETS); on a CPU 8,
# where a verify pass is arithmetic-bound by batch 8 (BENCHMARKS.md, CPU speed), so more rows
# lengthen every step instead of adding throughput, and the CPU pool grows with the slots
GPU_DEFAULT_SLOTS = 256
CPU_DEFAULT_SLOTS = 8


@dataclass(frozen=True)
class PoolSize:
    num_slots: int
    num_blocks: int
    block_size: int  # tokens a block
    rule: str  # which setting sized the pool, for the start log
    graph_bytes: int = 0  # the CUDA graphs' estimated memory the pool left room for


@dataclass(frozen=True)
class GpuMemory:
    """Bytes on one GPU, measured with a pool of one block (workers/memory_profile.py)."""

    total: int
    free_at_start: int  # before this engine loaded anything; other processes hold the rest
    engine: int  # held since the start: weights, per-slot state, workspaces, NCCL buffers
    peak_step: int  # activations of the peak step, above what stays allocated after it
    graphs: int  # the CUDA graphs, estimated before their one capture (0 without them)

    def report(self, utilization: float) -> str:
        return (
            f"gpu_memory_utilization={utilization}: {utilization * self.total / GiB:.2f} of "
            f"{self.total / GiB:.2f} GiB ({self.free_at_start / GiB:.2f} GiB free at start); "
            f"weights and other memory {self.engine / GiB:.2f} GiB, peak step "
            f"{self.peak_step / GiB:.2f} GiB, CUDA graphs {self.graphs / GiB:.2f} GiB (estimated)"
        )

    def advice(self, utilization: float) -> str:
        """What to change when the pool is too small."""
        if self.free_at_start < utilization * self.total:  # other processes hold the GPU
            fraction = self.free_at_start / self.total
            return f"lower gpu_memory_utilization to {fraction:.2f} or less, free the GPU, "
        return "raise gpu_memory_utilization, lower max_batch_size or max_num_batched_tokens, "


def cache_rows(max_model_len: int, k: int, siblings: int, block_size: int) -> int:
    """KV rows per request, in whole blocks: room for K+1 tokens past the last real one, twice (a
    step in flight may overrun a finished request), and for the verify pass's siblings past the
    chain (speculative/engine/block_manager.py's RequestBlocks counts the same)."""
    rows = max_model_len + 2 * (k + 1) + k * siblings + 1
    return -(-rows // block_size) * block_size


def full_length_gb(model_cfg, num_slots: int, max_model_len: int, dtype, block_size=16) -> float:
    """kv_cache_memory_gb for num_slots requests at max_model_len of a target alone (TP 1, no
    drafter), with a block to spare (the GiB are a float)."""
    per_token = KVShape.of(model_cfg, 1, model_cfg.num_hidden_layers).bytes_per_token(dtype)
    rows = num_slots * cache_rows(max_model_len, 0, 0, block_size) + block_size
    return rows * per_token / GiB


def default_slots(cfg, is_cuda: bool) -> int:
    """Request slots where max_batch_size is not set: GPU_DEFAULT_SLOTS or CPU_DEFAULT_SLOTS, at
    most the rows whose verify tokens (1 + K(M+1) a row) fit one step's max_num_batched_tokens,
    as vLLM caps max_num_seqs at max_num_batched_tokens."""
    cap = GPU_DEFAULT_SLOTS if is_cuda else CPU_DEFAULT_SLOTS
    siblings = cfg.draft_siblings if cfg.k else 0
    return max(1, min(cap, cfg.max_num_batched_tokens // (1 + cfg.k * (siblings + 1))))


def slots_that_fit(cfg, per_slot_bytes: int, is_cuda: bool) -> int:
    """Request slots: max_batch_size (else default_slots), fewer where memory_budget_gb holds
    fewer caches."""
    num_slots = cfg.max_batch_size or default_slots(cfg, is_cuda)
    if cfg.memory_budget_gb is None:
        return num_slots
    fits = int(cfg.memory_budget_gb * GiB // per_slot_bytes)
    if fits < 1:
        raise ValueError(
            f"memory_budget_gb={cfg.memory_budget_gb} holds no request slot "
            f"({per_slot_bytes / 2**20:.1f} MiB of KV cache per slot)"
        )
    return min(num_slots, fits)


def slots_the_pool_holds(cfg, num_slots: int, num_blocks: int) -> int:
    """Derived slots (no max_batch_size) at most the requests the pool holds at their smallest
    (one token and the rows its steps write past it): a slot no block could serve is not made."""
    if cfg.max_batch_size is not None:
        return num_slots
    siblings = cfg.draft_siblings if cfg.k else 0
    smallest = cache_rows(1, cfg.k, siblings, cfg.kv_block_size) // cfg.kv_block_size
    return max(1, min(num_slots, num_blocks // smallest))


def explicit_blocks(pool_gb: float, per_block_bytes: int) -> int:
    """The blocks kv_cache_memory_gb holds."""
    fits = int(pool_gb * GiB // per_block_bytes)
    if fits < 1:
        raise ValueError(
            f"kv_cache_memory_gb={pool_gb} holds no KV block "
            f"({per_block_bytes / 2**10:.1f} KiB per block)"
        )
    return fits


def cpu_blocks(num_slots: int, blocks_per_request: int, per_block_bytes: int) -> int:
    """Every slot at full length, at most CPU_KV_CACHE_GB."""
    return min(num_slots * blocks_per_request, int(CPU_KV_CACHE_GB * GiB // per_block_bytes))


def gpu_blocks(mem: GpuMemory, utilization: float, per_block_bytes: int) -> int:
    """What utilization x the GPU leaves for the pool after everything else; 0 where it leaves
    nothing, or where other processes hold so much that less than that was free at start."""
    budget = int(utilization * mem.total)
    if mem.free_at_start < budget:
        return 0
    return max(0, budget - mem.engine - mem.peak_step - mem.graphs) // per_block_bytes


def check_holds_a_request(
    num_blocks: int, blocks_per_request: int, max_model_len: int, why: str, advice: str
) -> None:
    if num_blocks < blocks_per_request:
        raise ValueError(
            f"{why} leaves room for {num_blocks} KV cache blocks, fewer than one request at "
            f"max_model_len {max_model_len} needs ({blocks_per_request}): {advice}lower "
            "max_model_len, or set kv_cache_memory_gb"
        )


def static_pool_size(
    cfg,
    per_token_bytes: int,
    cache_len: int,
    max_model_len: int,
    is_cuda: bool,
    num_slots: int | None = None,
) -> PoolSize | None:
    """The pool by kv_cache_memory_gb or the CPU default; None where the GPU must be measured.
    num_slots: the request slots (None: slots_that_fit's on this device)."""
    block_size = cfg.kv_block_size
    per_block = per_token_bytes * block_size
    blocks_per_request = cache_len // block_size
    if num_slots is None:
        num_slots = slots_that_fit(cfg, per_token_bytes * cache_len, is_cuda)
    if cfg.kv_cache_memory_gb is not None:
        num_blocks = explicit_blocks(cfg.kv_cache_memory_gb, per_block)
        num_slots = slots_the_pool_holds(cfg, num_slots, num_blocks)
        rule = f"kv_cache_memory_gb={cfg.kv_cache_memory_gb}"
        return PoolSize(num_slots, num_blocks, block_size, rule)
    if is_cuda:
        return None
    num_blocks = cpu_blocks(num_slots, blocks_per_request, per_block)
    why = f"the CPU default of every slot at full length, at most {CPU_KV_CACHE_GB} GiB,"
    check_holds_a_request(num_blocks, blocks_per_request, max_model_len, why, "")
    return PoolSize(num_slots, num_blocks, block_size, why.rstrip(","))
