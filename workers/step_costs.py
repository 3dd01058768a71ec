"""The cost of a decode step at each batch size and K, measured at start on the real runner for
`num_draft_tokens: auto` (speculative/engine/draft_tuner.py keeps it current from the steps'
timings). Each rank runs the same plans, so a tensor-parallel group measures together."""

import logging
import statistics

import torch

from speculative.config import SamplingParams
from speculative.draft_length import bucket
from speculative.plan import PrefillRow, StepPlan

log = logging.getLogger(__name__)

PROMPT_LEN = 32  # tokens each profiled row holds before its decode steps
REPEATS = 5  # timed steps per (batch, K), after one untimed


def profile_step_costs(runner) -> dict[tuple[int, int], float]:
    """-> {(batch bucket, K): seconds of a decode step}: max(host time, device time) of each,
    the median of REPEATS. Leaves every slot free."""
    K = runner.K
    steps_per_k = REPEATS + 1
    tokens = PROMPT_LEN + (K + 1) * (K + 1) * steps_per_k  # the most a row reaches
    blocks_per_row = -(-tokens // runner.block_size)
    sizes = sorted({min(bucket(b), runner.num_slots) for b in range(1, runner.num_slots + 1)})
    sizes = [b for b in sizes if b * blocks_per_row <= runner.num_blocks]
    costs = {}
    for batch in sizes:
        costs |= _profile_batch(runner, batch, blocks_per_row, steps_per_k)
    log.info(
        "rank %d: decode step costs (ms) %s",
        runner.rank,
        {key: round(s * 1000, 2) for key, s in sorted(costs.items())},
    )
    return costs


def _profile_batch(runner, batch: int, blocks_per_row: int, steps_per_k: int) -> dict:
    K, slots = runner.K, list(range(batch))
    updates = [(s, i, s * blocks_per_row + i) for s in slots for i in range(blocks_per_row)]
    kv_len = blocks_per_row * runner.block_size
    prompt = list(range(1, PROMPT_LEN + 1))
    prefills = [PrefillRow(s, prompt, s, SamplingParams()) for s in slots]
    runner.execute(StepPlan(0, prefills, kv_len=kv_len, block_updates=updates)).result()
    seconds, step = {k: [] for k in range(K + 1)}, 1
    # every K in each round, the order reversed every other round: a load that changes while
    # this runs changes every K's timings alike
    for round_ in range(steps_per_k):
        for k in range(K + 1) if round_ % 2 else range(K, -1, -1):
            plan = StepPlan(step, decode_slots=slots, kv_len=kv_len)
            step += 1
            if k < K:  # K: the all-K form, graphed where the graphs fit
                plan.draft_counts, plan.draft_limits = [k] * batch, [k] * batch
            result = runner.execute(plan).result()
            seconds[k].append(max(result.execute_s, result.device_s))
    costs = {(bucket(batch), k): statistics.median(s[1:]) for k, s in seconds.items()}
    for s in slots:
        runner.resources.free(s)
    runner.kv.block_table[: runner.num_slots].fill_(runner.kv.dummy_block)
    return costs


def maybe_profile(runner) -> dict | None:
    """The profile when the engine's K is auto (and it drafts), else None."""
    if not runner.cfg.is_auto_k or runner.proposer is None:
        return None
    with torch.inference_mode():
        return profile_step_costs(runner)
