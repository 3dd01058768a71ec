"""Sizing a rank's KV pool (the arithmetic is workers/kv_sizing.py's); on CUDA without
kv_cache_memory_gb, by measuring the GPU as vLLM does: with a pool of one block, run the engine's
peak step (`run_peak_steps`), estimate the CUDA graphs without capturing them
(`estimate_graph_bytes`), and give the pool what gpu_memory_utilization leaves."""

import gc
import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from speculative.config import MAX_STOP_IDS, SamplingParams
from speculative.plan import PrefillRow, StepPlan
from workers.graph_memory import estimate_graph_bytes
from workers.kv_sizing import (
    CPU_DEFAULT_SLOTS,
    GPU_DEFAULT_SLOTS,
    GpuMemory,
    PoolSize,
    check_holds_a_request,
    gpu_blocks,
    slots_that_fit,
    slots_the_pool_holds,
    static_pool_size,
)
from workers.layers import attention_backend
from workers.layers.kv_cache import bytes_per_token, kv_shapes

log = logging.getLogger(__name__)

START_WAIT_S = 15.0  # for the memory of an engine this one replaces, whose process may be exiting
# every feature that allocates memory in a step: sampling, log-probabilities, penalties, bias,
# min_tokens (the plans also turn on draft limits and grammar masks)
HEAVIEST = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    top_k=50,
    min_p=0.05,
    logprobs=20,
    prompt_logprobs=20,
    frequency_penalty=0.5,
    presence_penalty=0.5,
    repetition_penalty=1.1,
    logit_bias={0: 1.0},
    min_tokens=1,
)


def memory_at_start(device: torch.device, cfg) -> tuple[int, int] | None:
    """(free, total) bytes of the GPU before this engine loads anything, where its pool will be
    sized by measuring (CUDA, no kv_cache_memory_gb); else None."""
    if device.type != "cuda" or cfg.kv_cache_memory_gb is not None:
        return None
    gc.collect()  # an earlier engine of this process, unreachable but not yet collected
    torch.cuda.empty_cache()
    deadline = time.monotonic() + START_WAIT_S
    free, total = torch.cuda.mem_get_info(device)
    while free < cfg.gpu_memory_utilization * total and time.monotonic() < deadline:
        time.sleep(0.5)
        free, total = torch.cuda.mem_get_info(device)
    return free, total


def size_pool(runner, cache_len: int, at_start: tuple[int, int] | None) -> PoolSize:
    """The runner's pool: by kv_cache_memory_gb or the CPU default, else (at_start: the GPU's
    memory before the weights) by measuring."""
    cfg, max_len = runner.cfg, runner.max_model_len
    shapes = kv_shapes(runner.target, runner.drafter, runner.tp)
    per_token = bytes_per_token(shapes, runner.kv_dtype)
    is_cuda = runner.device.type == "cuda"
    num_slots = slots_that_fit(cfg, per_token * cache_len, is_cuda)
    measures = at_start is not None
    size = static_pool_size(cfg, per_token, cache_len, max_len, measures, num_slots)
    if size is None:
        size = _measured_pool(runner, cache_len, at_start, per_token, num_slots)
    if cfg.max_batch_size is None:
        log.info(
            "rank %d: max_batch_size not set: %d request slots (at most %d on %s, as many verify "
            "rows as max_num_batched_tokens=%d holds, and the requests the pool holds)",
            runner.rank,
            size.num_slots,
            GPU_DEFAULT_SLOTS if is_cuda else CPU_DEFAULT_SLOTS,
            "CUDA" if is_cuda else "CPU",
            cfg.max_num_batched_tokens,
        )
    return size


def _measured_pool(runner, cache_len: int, at_start, per_token: int, num_slots: int):
    """The pool by gpu_memory_utilization: what the measured GPU (with num_slots request slots)
    leaves for it; every rank takes the smallest, since the plans address one pool."""
    cfg, max_len = runner.cfg, runner.max_model_len
    mem = measure_gpu(runner, cache_len, num_slots, at_start)
    utilization = cfg.gpu_memory_utilization
    num_blocks = gpu_blocks(mem, utilization, per_token * cfg.kv_block_size)
    if runner.group is not None:
        agreed = torch.tensor([num_blocks], device=runner.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=runner.group)
        num_blocks = int(agreed.item())
    report = mem.report(utilization)
    log.info("rank %d: %s -> %d KV cache blocks", runner.rank, report, num_blocks)
    advice = mem.advice(utilization)
    check_holds_a_request(num_blocks, cache_len // cfg.kv_block_size, max_len, report, advice)
    # fewer slots than were profiled: the measured peak step stays an upper bound
    num_slots = slots_the_pool_holds(cfg, num_slots, num_blocks)
    rule = f"gpu_memory_utilization={utilization}"
    return PoolSize(num_slots, num_blocks, cfg.kv_block_size, rule, mem.graphs)


def measure_gpu(runner, cache_len: int, num_slots: int, at_start: tuple[int, int]) -> GpuMemory:
    """The runner's memory with a pool of one block (its per-slot state as it will be): held,
    at the peak step, and in its CUDA graphs (estimated). Leaves the runner to be allocated
    again."""
    free_at_start, total = at_start
    runner._allocate(cache_len, PoolSize(num_slots, 1, runner.cfg.kv_block_size, "profiling"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        run_peak_steps(runner, cache_len)
    except torch.cuda.OutOfMemoryError as e:
        raise RuntimeError(
            f"the peak step ({runner.num_slots} requests at max_model_len {runner.max_model_len}, "
            f"{runner.cfg.max_num_batched_tokens} prefill tokens) does not fit the GPU beside the "
            "weights: lower max_batch_size, max_model_len or max_num_batched_tokens"
        ) from e
    torch.cuda.synchronize()
    peak_step = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    graphs = 0
    if runner.cfg.cuda_graphs:  # estimated: the one capture comes once the pool is allocated
        with torch.inference_mode():
            graphs = estimate_graph_bytes(runner)
    torch.cuda.empty_cache()
    engine = free_at_start - torch.cuda.mem_get_info(runner.device)[0]
    # at least what torch holds: memory another process freed since the start would lower it
    engine = max(engine, torch.cuda.memory_reserved())
    return GpuMemory(total, free_at_start, engine, peak_step, graphs)


def peak_prefill_rows(num_slots: int, budget: int, gathers_long_rows: bool) -> list[int]:
    """How many rows the profiled prefills split the budget into, fewest first: one row (a chunk
    of one long prompt), or where rows longer than the paged kernel's query rows gather every
    block of their context (gathers_long_rows: attention_backend), as many rows as each hold
    more than those, where those are fewer than the slots; then every slot, its share each."""
    long_rows = 1
    if gathers_long_rows:
        long_rows = max(1, min(num_slots, budget // (attention_backend.KERNEL_MAX_QUERY + 1)))
    return sorted({long_rows, num_slots})


def run_peak_steps(runner, cache_len: int) -> None:
    """The largest steps the engine runs: prefill plans splitting max_num_batched_tokens over
    `peak_prefill_rows` rows, each at the end of its context (chunks of long prompts), then
    every slot verifying; all read cache_len rows a request. Leaves the slots' state to be
    discarded."""
    num_slots, max_len = runner.num_slots, runner.max_model_len
    budget = runner.cfg.max_num_batched_tokens
    stops = dict(stops_from=1 << 40, stop_ids=[0] * MAX_STOP_IDS)
    taken = []  # the slots the last plan's prefills hold: the next plan frees them first
    # with the prefill kernel no step copies a context: the peak is the activations'
    gathers = not attention_backend.use_paged_kernel(runner.device, budget)
    for step, num_rows in enumerate(peak_prefill_rows(num_slots, budget, gathers)):
        length = max(1, min(budget // num_rows, max_len - 1))
        prefills = [
            PrefillRow(slot, [0] * length, slot, HEAVIEST, start=max_len - length, **stops)
            for slot in range(num_rows)
        ]
        flags = _heaviest_flags(runner, num_rows, cache_len)
        plan = StepPlan(
            step,
            prefills,
            free_slots=taken,
            num_prompt_logprobs=HEAVIEST.prompt_logprobs,
            **flags,
        )
        runner.execute(plan).result()
        taken = list(range(num_rows))
    flags = _heaviest_flags(runner, num_slots, cache_len)
    verify = StepPlan(step + 1, decode_slots=taken, **flags)
    runner.execute(verify).result()


def _heaviest_flags(runner, num_rows: int, kv_len: int) -> dict:
    """Every feature of a step of num_rows rows on (HEAVIEST's), reading kv_len rows a request."""
    vocab_words = -(-runner.target_cfg.vocab_size // 32)
    return dict(
        kv_len=kv_len,
        all_greedy=False,
        use_top_k_top_p=True,
        use_min_p=True,
        num_logprobs=HEAVIEST.logprobs,
        use_penalties=True,
        use_logit_bias=True,
        use_min_tokens=True,
        draft_limits=[runner.K] * num_rows,
        grammar_rows=list(range(num_rows)),
        grammar_masks=np.full((num_rows, runner.T, vocab_words), -1, dtype=np.int32),
    )
