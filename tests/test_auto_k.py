"""`num_draft_tokens: auto` through the real engine (SmolLM2, the shipped drafter, the start-up
cost profile, every step graph as the CPU stand-in): with proposals forced to be always wrong it
stops drafting (K -> 0), with the target's own greedy continuation it drafts the most
(K -> max); forced through every K, alone and beside rows of fixed K; output stays plain
decoding's. The decision itself: tests/test_draft_length.py."""

import contextlib
import itertools

import pytest
import torch
from conftest import run_to_completion

from speculative.config import SamplingParams

K_MAX = 5


@pytest.fixture(scope="module")
def auto_engine():
    """Auto K with every step graph (the CPU stand-in, its shared pool included)."""
    from conftest import _smollm2, replay_graphs_on_cpu

    engine = _smollm2("default", num_draft_tokens="auto", max_batch_size=4)
    replay_graphs_on_cpu(engine.executor)
    return engine


@contextlib.contextmanager
def forced_proposals(engine, token_at):
    """The real drafter runs as ever, but each draft is token_at(q + 2) [B]: the drafter's output
    at position q has seen the token at q + 1 and drafts the one after it."""
    proposer = engine.executor.proposer
    real = proposer._choose

    def choose(h, slots, q, allowed, forced):
        return token_at(q + 2), real(h, slots, q, allowed, forced)[1]

    proposer._choose = choose
    try:
        yield
    finally:
        proposer._choose = real


def _run(engine, prompt, token_at, max_tokens=48):
    tuner = engine.scheduler.tuner
    before = list(tuner.num_steps_by_k)
    with forced_proposals(engine, token_at):
        (request,) = run_to_completion(engine, [prompt], SamplingParams(max_tokens=max_tokens))
    steps = [n - b for n, b in zip(tuner.num_steps_by_k, before)]
    return request, steps


def test_profiled_costs_at_start(auto_engine):
    costs = auto_engine.executor.step_costs
    assert {k for _, k in costs} == set(range(K_MAX + 1))
    assert all(seconds > 0 for seconds in costs.values())


def test_always_right_drafts_draft_the_most(auto_engine, smollm2_prompts, smollm2_greedy_64):
    prompt = smollm2_prompts[1]
    sequence = torch.tensor(prompt + smollm2_greedy_64[1])
    request, steps = _run(auto_engine, prompt, lambda at: sequence[at.clamp(max=len(sequence) - 1)])
    assert request.output_ids == smollm2_greedy_64[1][:48]
    assert list(auto_engine.scheduler.tuner.recent)[-4:] == [K_MAX] * 4, steps
    assert steps[K_MAX] >= 0.5 * sum(steps[1:]), steps  # where it drafts, mostly the most
    assert request.acceptance_length > 4


def test_always_wrong_drafts_stop_drafting(auto_engine, smollm2_prompts, smollm2_greedy_64):
    """After the always-right request above: the overall acceptance is high, and this request's
    own verifies soon outweigh it."""
    reference = smollm2_greedy_64[0]
    wrong = next(t for t in range(100, 200) if t not in reference)
    request, steps = _run(auto_engine, smollm2_prompts[0], lambda at: torch.full_like(at, wrong))
    assert request.output_ids == reference[:48]
    # plain decoding, but for the first steps (before the verifies tell) and the probes
    assert steps[0] >= 0.75 * sum(steps), steps
    assert sum(k > 0 for k in list(auto_engine.scheduler.tuner.recent)[-16:]) <= 1  # a probe


@contextlib.contextmanager
def forced_choices(tuner, ks):
    """The tuner picks the Ks of `ks` in turn, whatever it measures (its counts kept)."""
    real, picks = tuner.choose, itertools.cycle(ks)

    def choose(*args, **kwargs):
        real(*args, **kwargs)
        k = next(picks)
        tuner.num_steps_by_k[tuner.recent.pop()] -= 1
        tuner.num_steps_by_k[k] += 1
        tuner.recent.append(k)
        return k

    tuner.choose = choose
    try:
        yield
    finally:
        tuner.choose = real


CYCLE = [K_MAX, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, K_MAX, K_MAX, 0, K_MAX, 3, 0, 2]


@pytest.mark.parametrize("ks", [["auto"], ["auto", 1, 0, 3]], ids=["alone", "beside_fixed_k"])
def test_every_k_in_graphs_equals_plain(auto_engine, smollm2_prompts, smollm2_greedy_64, ks):
    """The tuner forced through every K from the most to 0 and back, alone in its batch (the
    whole chain's graph after a lowered K's verify_by_width) and beside rows of fixed K: each
    row's output is plain decoding's and no row emits more than it verified (on the H100 the
    chain's replay overwrote verify_by_width's outputs in their shared pool)."""
    engine, n = auto_engine, len(ks)
    tuner, graphs = engine.scheduler.tuner, engine.executor.graphs
    before = list(tuner.num_steps_by_k), graphs.chain.replays
    params = [SamplingParams(max_tokens=48, num_draft_tokens=k) for k in ks]
    with forced_choices(tuner, CYCLE):
        requests = run_to_completion(engine, smollm2_prompts[:n], params)
    assert [r.output_ids for r in requests] == [ref[:48] for ref in smollm2_greedy_64[:n]]
    chosen = [a - b for a, b in zip(tuner.num_steps_by_k, before[0])]
    assert all(chosen), chosen  # every K from 0 to the most
    assert sum(g.replays for g in graphs.verify_by_width.values()) > 0
    if n == 1:
        assert graphs.chain.replays > before[1]
    assert requests[0].acceptance_length > 1.5
