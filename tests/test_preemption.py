"""Preemption by recompute as a plain state machine: the scheduler and block manager against a
fake greedy worker, over many random workloads (requests of different lengths joining mid-flight,
EOS and length stops, aborts, chunked prefill, the prefix cache, a pool that forces preemption),
with overlap off (plan, then process) and on (one step in flight), under both scheduling
policies (priority: random priorities, so requests are admitted and preempted out of order). The
fake keeps token ids where a worker keeps K/V, in a pool read through the block table, so a block
given to the wrong request, reused too early or cached with a rejected draft's row changes the
tokens. Every request's stream must be plain greedy decoding's, each token once; the pool and
slots whole."""

import random
from collections import deque

import numpy as np
import pytest

from speculative.config import SamplingParams
from speculative.engine.block_manager import BlockManager
from speculative.engine.request import RequestError
from speculative.engine.scheduler import Scheduler
from speculative.plan import PrefillRow, StepPlan, StepResult

V, EOS, BLOCK = 50, 1, 4  # vocabulary, EOS token, tokens per block
GARBAGE = -2  # a rejected draft's K/V row


def next_token(seq: list[int]) -> int:
    """The fake model: greedy, a function of the whole sequence (ints hash alike every run)."""
    return hash(tuple(seq)) % V


def greedy(prompt: list[int], params: SamplingParams) -> list[int]:
    out = []
    while len(out) < params.max_tokens and (params.ignore_eos or EOS not in out):
        out.append(next_token(prompt + out))
    return out


class FakeWorker:
    """A worker's per-slot state over a pool of token ids: a step writes each row's tokens at
    their positions through the block table and reads the sequence back the same way."""

    def __init__(self, num_blocks: int, k: int, rng: random.Random):
        self.pool = np.full((num_blocks, BLOCK), -1)
        self.table: dict[int, dict[int, int]] = {}  # slot -> {block index: block}
        self.length: dict[int, int] = {}  # slot -> positions written before the pending token
        self.pending: dict[int, int] = {}  # slot -> the token the next verify pass writes
        self.k, self.rng = k, rng

    def write(self, slot: int, position: int, token: int) -> None:
        self.pool[self.table[slot][position // BLOCK], position % BLOCK] = token

    def read(self, slot: int, n: int) -> list[int]:
        table = self.table[slot]
        return [int(self.pool[table[p // BLOCK], p % BLOCK]) for p in range(n)]

    def execute(self, plan: StepPlan) -> StepResult:
        for row in plan.prefills:
            if not row.is_continued:
                self.table[row.slot] = {}
        for slot, index, block in plan.block_updates:
            self.table[slot][index] = block
        rows = [self.prefill(r) for r in plan.prefills]
        rows += [self.verify(slot) for slot in plan.decode_slots]
        tokens = np.zeros((len(rows), self.k + 1), dtype=np.int64)  # [rows, K+1]
        for i, emitted in enumerate(rows):
            tokens[i, : len(emitted)] = emitted
        return StepResult(plan.step_id, tokens, np.array([max(1, len(e)) for e in rows]))

    def prefill(self, row: PrefillRow) -> list[int]:
        for j, token in enumerate(row.token_ids):
            self.write(row.slot, row.start + j, token)
        end = row.start + len(row.token_ids)
        if row.next_token >= 0:  # a chunk short of the end emits nothing
            return []
        self.length[row.slot] = end
        self.pending[row.slot] = next_token(self.read(row.slot, end))
        return [self.pending[row.slot]]

    def verify(self, slot: int) -> list[int]:
        """The pending token and K drafts, of which a random number are accepted; the rejected
        drafts' rows hold garbage until overwritten."""
        n = self.length[slot]
        seq = self.read(slot, n) + [self.pending[slot]]
        emitted = []
        for _ in range(1 + self.rng.randint(0, self.k)):
            emitted.append(next_token(seq + emitted))
        rows = [self.pending[slot]] + emitted[:-1]
        for j, token in enumerate(rows + [GARBAGE] * (self.k + 1 - len(rows))):
            self.write(slot, n + j, token)
        self.length[slot], self.pending[slot] = n + len(emitted), emitted[-1]
        return emitted


def workload(rng: random.Random, policy: str) -> list[tuple[int, list[int], SamplingParams]]:
    """(engine steps before it joins, prompt, params): some share a prefix, some stop at EOS;
    under the priority policy each has a priority of -1 to 3."""
    shared = [rng.randrange(2, V) for _ in range(rng.choice([0, 9, 17]))]
    requests = []
    for step in sorted(rng.randint(0, 25) for _ in range(rng.randint(3, 10))):
        prompt = [rng.randrange(2, V) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5)
        if policy == "priority":
            params = params.model_copy(update={"priority": rng.randint(-1, 3)})
        requests.append((step, (shared if rng.random() < 0.6 else []) + prompt, params))
    return requests


def run(seed: int, overlap: bool, policy: str = "fcfs") -> Scheduler:
    """One random workload to its end, each request's stream checked."""
    rng = random.Random(seed)
    k, num_slots, num_blocks = rng.choice([0, 1, 3]), rng.choice([2, 4]), rng.choice([14, 20, 32])
    blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=rng.random() < 0.8)
    budget = rng.choice([16, 32, 256])
    s = Scheduler(num_slots, 256, budget, k, {EOS}, seed=seed, blocks=blocks, policy=policy)
    worker, in_flight = FakeWorker(num_blocks, k, rng), deque()
    pending = deque(workload(rng, policy))
    requests, streamed, step = [], {}, 0
    abort_at = {rng.randint(0, 30): rng.randrange(len(pending))}
    while pending or s.has_work or in_flight:
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.popleft()
            try:
                requests.append(s.add(f"r{len(requests)}", prompt, params))
            except RequestError:  # can never fit the pool
                pass
        if step in abort_at and abort_at[step] < len(requests):
            s.abort(requests[abort_at[step]].request_id)
        plan = s.plan()
        if plan is not None:
            assert len(set(plan.slots)) == len(plan.slots) and None not in plan.slots
            in_flight.append((plan, worker.execute(plan)))
        if len(in_flight) > overlap or (plan is None and in_flight):
            for out in s.process(*in_flight.popleft()):
                streamed.setdefault(out.request_id, []).append(out)
        step += 1
        assert step < 3000, "the scheduler stopped making progress"
    for r in requests:
        check_stream(r, streamed.get(r.request_id, []))
    return s


def check_stream(r, outputs: list) -> None:
    """Its tokens streamed once each, in order, ended once: greedy decoding's (an aborted
    request's as far as it came, with no end streamed: the caller ended it)."""
    reasons = [out.finish_reason for out in outputs]
    is_aborted = r.finish_reason == "abort"
    if is_aborted:
        assert reasons == [None] * len(outputs), r.request_id
    else:
        assert reasons == [None] * (len(outputs) - 1) + [r.finish_reason], r.request_id
    tokens = [t for out in outputs for t in out.new_token_ids]
    expected = greedy(r.prompt_ids, r.params)
    assert tokens == r.output_ids == expected[: len(tokens) if is_aborted else None]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_is_exact_and_leaves_the_pool_whole(overlap, policy):
    num_preempted = 0
    for seed in range(200):
        try:
            s = run(seed, overlap, policy)
            assert sorted(s.free_slots) == list(range(s.num_slots))
            assert not s.waiting and not s.running
            manager = s.kv.manager
            assert manager.num_free == manager.num_blocks
            assert manager.ref_counts == [0] * manager.num_blocks
        except Exception as e:
            e.add_note(f"workload seed {seed}, overlap {overlap}, policy {policy}")
            raise
        num_preempted += s.stats.num_preemptions
    assert num_preempted > 200  # the pool forced preemption often


def emit(plan: StepPlan, tokens: list[int]) -> StepResult:
    """One token per row, in the plan's row order (prefills, then decodes)."""
    return StepResult(plan.step_id, np.array(tokens).reshape(-1, 1), np.ones(len(tokens), int))


@pytest.mark.parametrize("overlap", [False, True])
def test_the_newest_gives_its_blocks_back_once(overlap):
    """Two requests fill a 3-block pool; the older one's next step needs a third block, so the
    newer gives its blocks back. Overlap off: it is requeued before its next step is planned,
    and planned again only once readmitted. Overlap on: its step in flight ends it (EOS), so it
    leaves, streamed once, and is never requeued."""
    s = Scheduler(2, 64, 64, 0, {EOS}, blocks=BlockManager(3, BLOCK))
    old = s.add("old", [2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=3))
    new = s.add("new", [8, 9], SamplingParams(max_tokens=3))
    first = s.plan()
    assert [row.slot for row in first.prefills] == [old.slot, new.slot] == [0, 1]
    if not overlap:
        s.process(first, emit(first, [10, 11]))
    second = s.plan()
    assert second.decode_slots == [0] and not second.prefills
    assert s.stats.num_preemptions == 1 and new.blocks == []
    if overlap:
        (_, ended) = s.process(first, emit(first, [10, EOS]))
        assert (ended.new_token_ids, ended.finish_reason) == ([EOS], "stop")
        assert new.finish_reason == "stop" and not s.waiting and s.free_slots == [1]
    else:
        assert list(s.waiting) == [new] and s.free_slots == [1] and new.slot is None
    pending, token = deque([second]), 20
    while pending:
        plan = pending.popleft()
        s.process(plan, emit(plan, list(range(token, token + len(plan.slots)))))
        token += len(plan.slots)
        if (plan := s.plan()) is not None:
            assert None not in plan.slots
            pending.append(plan)
    assert old.finish_reason == "length" and len(old.output_ids) == 3
    if overlap:
        assert (new.finish_reason, new.output_ids) == ("stop", [EOS])
    else:  # recomputed from its prompt and its output so far
        assert new.finish_reason == "length" and new.output_ids[0] == 11
        assert len(new.output_ids) == 3 and new.prefill_ids == [8, 9, 11]
    assert sorted(s.free_slots) == [0, 1] and not s.running and not s.waiting
    assert s.kv.manager.num_free == 3 and s.kv.manager.ref_counts == [0] * 3
