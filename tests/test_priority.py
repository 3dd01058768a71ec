"""The priority scheduling policy (vLLM's `--scheduling-policy priority`). The scheduler as a
plain state machine with fake one-token steps: admission by (priority, arrival), preemption of
the running request of largest (priority, arrival), a non-zero priority refused under fcfs. Then
the tiny target with a drafter on a pool that forces preemption: priorities change the order in
which requests are served, never their tokens (plain decoding's)."""

import numpy as np
import pytest
from conftest import run_to_completion, tiny_engine, tiny_prompts

from speculative.config import SamplingParams
from speculative.engine.block_manager import BlockManager
from speculative.engine.request import RequestError
from speculative.engine.scheduler import Scheduler
from speculative.plan import StepResult

EOS, BLOCK = 1, 4  # the fake steps' EOS, tokens per block


def params(priority: int, max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)


def step(s: Scheduler):
    """Plan the next step and process its results (token 7 for every row) -> the plan."""
    plan = s.plan()
    if plan is not None:
        n = len(plan.slots)
        s.process(plan, StepResult(plan.step_id, np.full((n, 1), 7), np.ones(n, int)))
    return plan


def run_out(s: Scheduler, watched: list) -> list[str]:
    """Step until nothing is left -> the watched requests' ids in the order they got a slot."""
    admitted = []
    while s.has_work:
        step(s)
        admitted += [r.request_id for r in watched if r.slot is not None]
        admitted = list(dict.fromkeys(admitted))  # each once, where it first came
    return admitted


def test_a_late_high_priority_request_is_admitted_before_earlier_waiting_ones():
    """One slot, held by a running request; two requests of priority 5 wait, then one of -1
    arrives: it goes first, and the two go in their arrival order."""
    s = Scheduler(1, 64, 64, 0, {EOS}, policy="priority")
    s.add("running", [2, 3], params(0))
    step(s)
    low_a, low_b = s.add("low-a", [4], params(5)), s.add("low-b", [5], params(5))
    high = s.add("high", [6], params(-1))
    assert list(s.waiting) == [high, low_a, low_b]
    assert run_out(s, [high, low_a, low_b]) == ["high", "low-a", "low-b"]
    assert all(len(r.output_ids) == 2 for r in (high, low_a, low_b))


def test_fcfs_refuses_a_priority():
    """As vLLM's documentation of the field says: a priority other than 0 needs the policy."""
    s = Scheduler(1, 64, 64, 0, {EOS})
    with pytest.raises(RequestError, match=r"priority 3 needs the priority scheduling policy"):
        s.add("a", [2], params(3))
    assert not s.waiting and not s.has_work
    s.add("b", [2], params(0))


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "b")])
def test_preemption_takes_the_lowest_priority_not_the_newest(policy, victim):
    """a (6 tokens) and b (2) run, then c (2) joins: the 6 blocks are all taken, and at the next
    step c needs one more. fcfs: the newest, c, gives its own back. priority (a 0, b 7, c -1: c
    is the newest and the most urgent): b, of the lowest priority, gives its blocks back."""
    s = Scheduler(3, 64, 64, 0, {EOS}, blocks=BlockManager(6, BLOCK), policy=policy)
    priorities = {"fcfs": (0, 0, 0), "priority": (0, 7, -1)}[policy]
    a = s.add("a", [2] * 6, params(priorities[0], max_tokens=4))
    b = s.add("b", [3, 4], params(priorities[1], max_tokens=4))
    step(s)
    c = s.add("c", [5, 6], params(priorities[2], max_tokens=4))
    step(s)
    assert s.kv.manager.num_free == 0 and s.stats.num_preemptions == 0
    plan = step(s)
    requests = {"a": a, "b": b, "c": c}
    assert s.stats.num_preemptions == 1 and [r.request_id for r in s.waiting] == [victim]
    slots = {r.slot for name, r in requests.items() if name != victim}
    assert set(plan.decode_slots) == slots and requests[victim].blocks == []
    run_out(s, [a, b, c])
    assert all(len(r.output_ids) == 4 for r in (a, b, c))
    assert s.kv.manager.num_free == 6 and sorted(s.free_slots) == [0, 1, 2]


# ---- the tiny target: the order changes, the tokens do not ----

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
JOINS = [0, 0, 1, 3, 4, 9, 15]  # engine steps before each request joins
PRIORITIES = [3, 2, 2, 0, 1, -1, -2]  # the later, the more urgent
POOL_GB = 20 * 16 * 1280 / 2**30  # 20 blocks of the tiny target and drafter: about two requests


def finishing_order(engine, prompts, params) -> tuple[list[list[int]], list[int]]:
    """Run the requests as they join -> (their outputs, their indices in the order they ended)."""
    ended, step = [], engine.step

    def step_and_record():
        outputs = step()
        ended.extend(int(o.request_id[4:]) for o in outputs if o.finish_reason is not None)
        return outputs

    engine.step = step_and_record
    requests = run_to_completion(engine, prompts, params, JOINS)
    return [r.output_ids for r in requests], ended


def test_priorities_change_the_order_not_the_tokens(tiny_dir, tiny_drafter_dir):
    """Seven requests joining mid-flight on a pool that holds about two, speculating with K=3:
    under the priority policy the two most urgent end first (fcfs: last), with preemptions under
    both, and every request's tokens are plain decoding's (fcfs, no drafter, no prefix cache)."""
    shared = tiny_prompts(1, seed=9, min_len=40, max_len=40)[0]
    prompts = [shared + p for p in tiny_prompts(len(JOINS), seed=3)]
    plain = tiny_engine(tiny_dir, enable_prefix_caching=False)
    reference = [r.output_ids for r in run_to_completion(plain, prompts, GREEDY)]
    runs = {}
    for policy in ("fcfs", "priority"):
        engine = tiny_engine(
            tiny_dir, tiny_drafter_dir, k=3, max_batch_size=4, kv_cache_memory_gb=POOL_GB,
            scheduling_policy=policy,
        )  # fmt: skip
        params = [
            GREEDY.model_copy(update={"priority": p if policy == "priority" else 0})
            for p in PRIORITIES
        ]
        outputs, runs[policy] = finishing_order(engine, prompts, params)
        assert outputs == reference, policy
        assert engine.scheduler.stats.num_preemptions > 0
        assert engine.scheduler.kv.manager.num_free == engine.scheduler.kv.manager.num_blocks
    # the two most urgent joined last: fcfs serves them last, priority first
    assert runs["fcfs"][-2:] == [5, 6] and sorted(runs["priority"][:2]) == [5, 6]
