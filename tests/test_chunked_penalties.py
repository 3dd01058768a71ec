"""Penalties and prompt log-probabilities under chunked prefill and the prefix cache, on the tiny
target: a slot's prompt tokens and output counts are built chunk by chunk (a cached prefix's from
the ids the plan carries), so greedy and sampled tokens equal a whole, uncached prefill's, with
speculation and without, joining mid-flight or preempted and recomputed; prompt log-probabilities
cover every prompt position and equal the whole prefill's, and such a request reads no cached
prefix (as in vLLM) while its own blocks are cached for others."""

import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts

from speculative.config import SamplingParams
from speculative.engine.request import RequestError

JOINS = [0, 0, 1, 3, 4, 9]  # engine steps before each request joins
BUDGET = 16  # max_num_batched_tokens of the chunked engines: every prompt takes several steps
BLOCK_BYTES = 16 * 1280  # a 16-token block of the tiny target (4 layers) and drafter (1 layer)
BASE = SamplingParams(max_tokens=24, ignore_eos=True)
PARAMS = [  # the penalties as test_lossless checks them against transformers
    BASE.model_copy(update={"frequency_penalty": 0.8, "prompt_logprobs": 2}),
    BASE.model_copy(update={"presence_penalty": 1.5, "repetition_penalty": 1.3}),
    BASE.model_copy(update={"repetition_penalty": 1.8}),
    BASE.model_copy(update={"prompt_logprobs": 3}),  # none, beside the others
    BASE.model_copy(
        update={"temperature": 0.9, "seed": 4, "frequency_penalty": -0.5, "repetition_penalty": 0.8}
    ),
    BASE.model_copy(update={"temperature": 0.7, "seed": 5, "presence_penalty": 0.5}),
]


@pytest.fixture(scope="module")
def prompts():
    """A 40-token prefix shared by every prompt (two whole blocks), then 3..40 of its own."""
    shared = tiny_prompts(1, seed=9, min_len=40, max_len=40)[0]
    return [shared + p for p in tiny_prompts(len(JOINS), seed=3)]


def drafter_dir(name: str, tiny_drafter_dir):
    return tiny_drafter_dir if name == "drafter" else "none"


def run(engine, prompts, params, joins=None) -> tuple[list, list, list]:
    """Run to completion, recording the plans. -> (each request's output ids, the prompt
    log-probabilities it streamed, or None, the plans)."""
    plans, execute, prompt_logprobs = [], engine.executor.execute, {}
    engine.executor.execute = lambda plan: plans.append(plan) or execute(plan)

    def record(i, out):
        if out.prompt_logprobs is not None:
            assert i not in prompt_logprobs  # sent once
            prompt_logprobs[i] = out.prompt_logprobs

    requests = run_to_completion(engine, prompts, params, joins, record)
    engine.executor.execute = execute
    outputs = [r.output_ids for r in requests]
    return outputs, [prompt_logprobs.get(i) for i in range(len(prompts))], plans


@pytest.fixture(scope="module", params=["none", "drafter"])
def whole(request, tiny_dir, tiny_drafter_dir, prompts):
    """(drafter, the outputs and prompt log-probabilities of whole, uncached prefills)."""
    drafter = drafter_dir(request.param, tiny_drafter_dir)
    engine = tiny_engine(tiny_dir, drafter, k=3, max_batch_size=4, enable_prefix_caching=False)
    outputs, prompt_logprobs, plans = run(engine, prompts, PARAMS, JOINS)
    assert all(row.next_token < 0 and row.start == 0 for p in plans for row in p.prefills)
    return drafter, outputs, prompt_logprobs


def assert_prompt_logprobs_equal(got: list, want: list, prompts: list) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (PARAMS[i].prompt_logprobs is None), i
        if g is None:
            continue
        assert len(g) == len(w) == len(prompts[i]) - 1
        assert [[t for t, _ in top] for _, top in g] == [[t for t, _ in top] for _, top in w]
        torch.testing.assert_close(values(g), values(w), rtol=1e-5, atol=1e-5)


def values(logprobs: list) -> torch.Tensor:
    """[positions, 1 + top]: each position's log-probability, then its top ones'."""
    return torch.tensor([[lp] + [v for _, v in top] for lp, top in logprobs])


def test_penalties_are_felt(tiny_dir, prompts, whole):
    _, outputs, _ = whole
    engine = tiny_engine(tiny_dir, enable_prefix_caching=False)
    plain, _, _ = run(engine, prompts[:3], [BASE] * 3)
    assert all(outputs[i] != plain[i] for i in range(3))


def test_chunks_after_a_cached_prefix_equal_whole_prefills(tiny_dir, prompts, whole):
    """One request after another under a 16-token budget: each after the first finds the
    shared prefix cached (except those scoring their prompt), and prefills the rest in chunks."""
    drafter, outputs, prompt_logprobs = whole
    engine = tiny_engine(tiny_dir, drafter, k=3, max_num_batched_tokens=BUDGET)
    got = [run(engine, [p], [params]) for p, params in zip(prompts, PARAMS)]
    assert [g[0][0] for g in got] == outputs
    assert_prompt_logprobs_equal([g[1][0] for g in got], prompt_logprobs, prompts)
    rows = [row for g in got for plan in g[2] for row in plan.prefills]
    penalised = [row for row in rows if row.params.has_penalties]
    assert any(row.next_token >= 0 for row in penalised)  # chunked
    assert any(len(row.cached_ids) == 32 for row in penalised)  # past a cached prefix
    # a request scoring its prompt reads no cached block: the 4 others hit the 2 shared blocks
    scorers = [i for i, p in enumerate(PARAMS) if p.prompt_logprobs is not None]
    assert all(got[i][2][0].prefills[0].start == 0 for i in scorers)
    stats = engine.scheduler.kv.manager.stats
    assert stats.num_hit_tokens == 32 * (len(prompts) - len(scorers))


def test_chunks_joining_mid_flight_equal_whole_prefills(tiny_dir, prompts, whole):
    """Requests joining while others decode: every step's prefill chunks share the budget with
    the running requests' verify rows."""
    drafter, outputs, prompt_logprobs = whole
    engine = tiny_engine(tiny_dir, drafter, k=3, max_batch_size=4, max_num_batched_tokens=BUDGET)
    got_outputs, got_prompt_logprobs, plans = run(engine, prompts, PARAMS, JOINS)
    assert got_outputs == outputs
    assert_prompt_logprobs_equal(got_prompt_logprobs, prompt_logprobs, prompts)
    assert any(p.decode_slots and any(r.next_token >= 0 for r in p.prefills) for p in plans)


def test_preempted_penalised_requests_are_recomputed_in_chunks(tiny_dir, prompts, whole):
    """A 12-block pool under the 16-token budget: the newest requests give their blocks back and
    are prefilled again, prompt and output, in chunks past cached blocks: their earlier output
    still counts as output, and each streams its prompt's log-probabilities once."""
    drafter, outputs, prompt_logprobs = whole
    engine = tiny_engine(
        tiny_dir, drafter, k=3, max_batch_size=4, max_num_batched_tokens=BUDGET,
        kv_cache_memory_gb=12 * BLOCK_BYTES / 2**30,
    )  # fmt: skip
    got_outputs, got_prompt_logprobs, plans = run(engine, prompts, PARAMS, JOINS)
    assert got_outputs == outputs
    assert_prompt_logprobs_equal(got_prompt_logprobs, prompt_logprobs, prompts)
    assert engine.scheduler.stats.num_preemptions > 0
    resumed = [row for p in plans for row in p.prefills if row.num_resumed]
    assert any(row.params.has_penalties and row.next_token >= 0 for row in resumed)


def test_a_prompt_logprobs_requests_blocks_serve_later_requests(tiny_dir, prompts):
    """It skips reading the cache, not writing it: the same prompt after it finds its blocks."""
    engine = tiny_engine(tiny_dir, max_num_batched_tokens=BUDGET)
    prompt = prompts[2][5:]  # not the shared prefix
    scored, _, _ = run(engine, [prompt], [PARAMS[3]])
    stats = engine.scheduler.kv.manager.stats
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (0, 0)
    again, _, _ = run(engine, [prompt], [BASE])
    assert again == scored and stats.num_hit_tokens == 16 * ((len(prompt) - 1) // 16)


def test_only_max_model_len_bounds_such_requests(tiny_dir):
    """Penalties and prompt_logprobs no longer need a prefill that fits one step: prompt +
    max_tokens past the step budget is served; past max_model_len (256) it is refused."""
    engine = tiny_engine(tiny_dir, max_num_batched_tokens=BUDGET)
    for update in ({"frequency_penalty": 0.5}, {"prompt_logprobs": 1}, {"repetition_penalty": 2}):
        fits, past = (BASE.model_copy(update=update | {"max_tokens": n}) for n in (156, 157))
        engine.scheduler.validate("a", [1] * 100, fits)
        with pytest.raises(RequestError, match="exceeds the maximum sequence length of 256"):
            engine.scheduler.validate("b", [1] * 100, past)
