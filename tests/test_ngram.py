"""Drafts without a drafter (`drafter: ngram`, speculative/ngram.py): the lookup against a plain
Python one, the drafts the engine makes against it after every step (prefix-cache hits and
reused slots included), greedy output equal to plain decoding (joining batches, per-row K, the
CPU graph stand-in, grammar rows, the real SmolLM2 on a copying prompt, where the drafts must be
accepted), and the sampled distribution by the chi-square test."""

import re

import pytest
import torch
from conftest import replay_graphs_on_cpu, run_to_completion, tiny_engine, tiny_prompts
from test_lossless import (
    SAMPLING,
    _engine,
    chi2_pvalue,
    exact_joint,
    sample_first_three,
    v16_dirs,  # noqa: F401 (a fixture)
)
from test_structured import raw_grammars

from speculative.config import EngineConfig, SamplingParams, StructuredSpec
from speculative.prompt_lookup import lookup

GREEDY = SamplingParams(max_tokens=60, ignore_eos=True)
N_MIN, N_MAX = 2, 4


def python_match_end(seq: list[int], n_min: int = N_MIN, n_max: int = N_MAX) -> int | None:
    """The end of the latest earlier occurrence of seq's last m tokens, for the longest m from
    n_max down to n_min that occurs earlier, or None."""
    for m in range(n_max, n_min - 1, -1):
        tail = seq[-m:]
        for end in range(len(seq) - 2, m - 2, -1):
            if seq[end - m + 1 : end + 1] == tail:
                return end
    return None


def python_match(seq: list[int], n_min: int = N_MIN, n_max: int = N_MAX) -> int | None:
    """The token after that occurrence, or None."""
    end = python_match_end(seq, n_min, n_max)
    return None if end is None else seq[end + 1]


def python_drafts(seq: list[int], K: int) -> list[int]:
    """The engine's K drafts after seq: the span after the match, repeating with its period where
    it reaches seq's end; none: seq's last token K times."""
    end = python_match_end(seq)
    if end is None:
        return [seq[-1]] * K
    period = len(seq) - 1 - end
    return [seq[end + 1 + j % period] for j in range(K)]


def test_lookup_takes_the_longest_match_then_the_latest():
    g = torch.Generator().manual_seed(0)
    history = torch.randint(0, 4, (64, 40), generator=g)  # 4 tokens: matches of every length
    q = torch.randint(0, 38, (64,), generator=g)
    for n_min, n_max in [(1, 1), (2, 4), (3, 6), (5, 5)]:
        found, token = lookup(history, q, n_max, n_min)
        expected = [python_match(history[r, : q[r] + 2].tolist(), n_min, n_max) for r in range(64)]
        assert found.tolist() == [e is not None for e in expected], (n_min, n_max)
        assert [int(t) for t, e in zip(token, expected) if e is not None] == [
            e for e in expected if e is not None
        ]
        assert found.any() and (n_min == 1 or (~found).any())


def check_drafts(engine, requests) -> int:
    """Every running request's K drafts against `python_drafts` over its tokens. -> the number
    checked."""
    checked, K = 0, engine.executor.K
    for r in requests:
        if r.slot is None or r.is_finished or not r.output_ids:
            continue
        drafts = engine.executor.state.drafts[r.slot, :K].tolist()
        assert drafts == python_drafts(r.prompt_ids + r.output_ids, K), r.request_id
        checked += K
    return checked


def test_drafts_follow_the_request_through_cache_hits_and_reused_slots(tiny_dir):
    """After every step the drafts are the span after the n-gram match in the prompt and the
    output: what the slot's history must hold through prefill, verification, rejected
    drafts and reused slots, with no host sync. The second wave's prompts hit the prefix cache,
    so their history's start comes from the cached prefix's ids, not from a prefill."""
    engine = tiny_engine(tiny_dir, "ngram", k=3, max_batch_size=3, overlap=False)
    engine.executor.check_host_sync = True  # workers/sync_guard.py: no step syncs the host
    waves = [[p * 3 for p in tiny_prompts(4, seed=s, min_len=12)] for s in (5, 5)]
    checked = 0
    for prompts in waves:
        requests = [engine.add_request(p, GREEDY) for p in prompts]
        while engine.has_work:
            engine.step()
            checked += check_drafts(engine, requests)
    assert engine.scheduler.kv.manager.stats.num_hit_tokens >= 4 * 16
    assert checked >= 200 and engine.scheduler.stats.num_draft_accepted > 0


@pytest.fixture(scope="module")
def prompts():
    return [p + p[:5] + p for p in tiny_prompts(6, seed=9)]


@pytest.fixture(scope="module")
def plain_ref(tiny_dir, prompts):
    engine = tiny_engine(tiny_dir, max_batch_size=4)
    return [r.output_ids for r in run_to_completion(engine, prompts, GREEDY)]


@pytest.mark.parametrize("k, graphs", [(1, False), (3, True), (5, False)])
def test_greedy_ngram_equals_plain(tiny_dir, prompts, plain_ref, k, graphs):
    """Requests joining mid-flight, with overlap; with graphs, every step through the CPU graph
    stand-in (a greedy step's verify and lookup replay as one graph)."""
    engine = tiny_engine(tiny_dir, "ngram", k=k, max_batch_size=4)
    engine.executor.check_host_sync = True
    if graphs:
        replay_graphs_on_cpu(engine.executor)
    requests = run_to_completion(engine, prompts, GREEDY, [0, 0, 1, 3, 5, 8])
    assert [r.output_ids for r in requests] == plain_ref
    assert engine.scheduler.stats.num_draft_accepted > 0
    if graphs:
        assert engine.executor.verifier.whole_step and engine.executor.graphs.verify.replays > 0


def test_per_row_k_and_auto_equal_plain(tiny_dir, prompts, plain_ref):
    """Rows verifying 0, 1, 2 or all of the K drafts, and the engine's auto K (profiled at start,
    then tuned each step) beside them."""
    for k, per_row in [(4, [0, 1, 2, None, 4, 3]), ("auto", [None, 0, 2, None, None, 1])]:
        engine = tiny_engine(tiny_dir, "ngram", k=k, max_batch_size=4)
        params = [GREEDY.model_copy(update={"num_draft_tokens": n}) for n in per_row]
        requests = run_to_completion(engine, prompts, params, [0, 0, 1, 3, 5, 8])
        assert [r.output_ids for r in requests] == plain_ref, k
        assert engine.scheduler.stats.num_draft_accepted > 0


def test_constrained_rows_equal_plain(tiny_dir):
    """Drafts that the grammar forbids are cut by the verify pass's masks: the output is plain
    constrained decoding's, a free row beside the constrained ones."""
    spec = StructuredSpec(kind="regex", spec="([a-d]{2}[e-h])+[q-z]{3}")
    constrained = SamplingParams(max_tokens=40, structured=spec, stop_token_ids=[63])
    params = [constrained, GREEDY, constrained]
    prompts = [p * 2 for p in tiny_prompts(3, seed=11)]
    outputs = []
    for drafter in ("none", "ngram"):
        engine = tiny_engine(tiny_dir, drafter, k=3)
        engine.scheduler.intake.grammars = raw_grammars(64, stop=63)
        outputs.append([r.output_ids for r in run_to_completion(engine, prompts, params)])
    assert outputs[0] == outputs[1]
    text = "".join(chr(ord("a") + t) for t in outputs[1][0][:-1])
    assert re.fullmatch(spec.spec, text), text


def test_sampled_distribution_with_ngram_drafts(v16_dirs):  # noqa: F811
    """Drafts looked up from sampled tokens, on a prompt that repeats itself, keep the target's
    distribution of the first three tokens."""
    prompt = [3, 1, 2, 7, 3, 1, 13, 9] * 2 + [3, 1]
    params = SAMPLING["t1"]
    joint, _ = exact_joint(v16_dirs[0], params, prompt)
    engine = _engine((v16_dirs[0], "ngram"), True, 3)
    counts = sample_first_three(engine, params, prompt=prompt)
    p_value = chi2_pvalue(counts, joint)
    print(f"chi-square p-value {p_value:.3g}")
    assert p_value > 1e-3
    assert engine.scheduler.stats.num_draft_accepted > 100


def test_options_that_need_a_drafter_are_refused():
    for bad in ({"prompt_lookup": 0.5}, {"draft_siblings": 1}):
        with pytest.raises(ValueError, match="need an EAGLE-3 drafter"):
            EngineConfig(drafter="ngram", **bad)
    with pytest.raises(ValueError, match="prompt_lookup_min must not exceed"):
        EngineConfig(drafter="ngram", prompt_lookup_min=5, prompt_lookup_max=3)


def test_smollm2_copying_accepts_drafts_and_equals_plain(smollm2_engine):
    """The real model asked to repeat a passage: its output is plain decoding's, and the drafts,
    copied from the passage, are mostly accepted (tokens per step well above one)."""
    from conftest import _smollm2

    passage = (
        "The engine keeps every request's tokens on the device, looks up the last few of them "
        "earlier in the request, and proposes the tokens that followed as drafts. "
    ) * 2
    prompt = smollm2_engine.tokenizer.encode(f"Repeat this text exactly:\n{passage}\nText:\n")
    params = SamplingParams(max_tokens=48)
    [plain] = smollm2_engine.generate([prompt], params)
    engine = _smollm2("ngram", num_draft_tokens=4)
    [copied] = engine.generate([prompt], params)
    assert copied.output_ids == plain.output_ids
    assert copied.acceptance_length > 2.0, copied.acceptance_length
