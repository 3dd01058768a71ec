"""`num_draft_tokens: auto` through the real engine (SmolLM2, the shipped drafter, the start-up
cost profile): with proposals forced to be always wrong it stops drafting (K -> 0), with the
target's own greedy continuation it drafts the most (K -> max); output stays plain decoding's.
The decision itself: tests/test_draft_length.py."""

import contextlib

import pytest
import torch
from conftest import run_to_completion

from speculative.config import SamplingParams

K_MAX = 5


@pytest.fixture(scope="module")
def auto_engine():
    from conftest import _smollm2

    return _smollm2("default", num_draft_tokens="auto", max_batch_size=2)


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
