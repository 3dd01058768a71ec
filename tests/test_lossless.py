"""Speculative decoding is lossless: greedy output equals plain greedy output token for token, and
sampled output has the target's distribution (checked against the exact distribution computed
from the target's logits, with deliberately wrong acceptance rules shown to fail the same check)."""

import random

import pytest
import torch
from conftest import (
    replay_graphs_on_cpu,
    run_to_completion,
    tiny_engine,
    tiny_prompts,
    write_random_drafter,
    write_tiny_llama,
)
from scipy.stats import chi2

from speculative.config import SamplingParams
from speculative.draft_tree import chain_path
from speculative.plan import PrefillRow, StepPlan
from speculative.sampling import prompt_logprobs
from speculative.verify import verify_sampled
from workers.model_runner import ModelRunner

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
JOINS = [0, 0, 1, 3, 4, 9, 15]  # engine steps before each request is added: they join mid-flight


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(len(JOINS), seed=3)


@pytest.fixture(scope="module")
def plain_ref(tiny_dir, prompts):
    engine = tiny_engine(tiny_dir)
    return [r.output_ids for r in run_to_completion(engine, prompts, GREEDY)]


# ---- greedy, tiny target ----


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_random_drafter_batch1(tiny_dir, tiny_drafter_dir, prompts, plain_ref, k):
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=k)
    for prompt, ref in zip(prompts[:3], plain_ref[:3]):
        (r,) = run_to_completion(engine, [prompt], GREEDY)
        assert r.output_ids == ref


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_random_drafter_joining_batch(tiny_dir, tiny_drafter_dir, prompts, plain_ref, k):
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=k, max_batch_size=4)
    requests = run_to_completion(engine, prompts, GREEDY, JOINS)
    assert [r.output_ids for r in requests] == plain_ref


def fresh_drafts(
    runner: ModelRunner, context: list[int], step_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts and their siblings a freshly started runner proposes after prefilling
    `context[:-1]` (whose greedy token must be context[-1]): what the incremental drafter KV
    cache must reproduce."""
    plan = StepPlan(
        step_id,
        prefills=[PrefillRow(0, context[:-1], 0, SamplingParams())],
        free_slots=[0] if step_id else [],
        kv_len=len(context) + runner.K + 1,
    )
    result = runner.execute(plan).result()
    assert result.tokens[0, 0] == context[-1]
    state = runner.state
    return state.drafts[0, : runner.K].clone(), state.siblings[0, :, : runner.K].clone()


def run_with_oracle(
    engine, prompts, refs, joins, corrupt_p, seed=0, check_against=None, params=None, outputs=None
):
    """Non-overlapped steps; after each, the drafts of every running request are overwritten with
    its known plain continuation, some positions corrupted, so drafts are accepted and rejected at
    every depth. With a draft tree, a corrupted draft's siblings hold the right token half the time
    (in a random one of them), and each step must emit exactly what the tree allows. With
    `check_against` (a fresh runner) the drafter's own proposals, read before they are overwritten,
    must equal what a fresh prefill of the same context proposes. `params`: per request (greedy
    ones, for the refs to hold); `outputs`: collects each request's RequestOutputs.
    -> the requests, in order (and the steps that went through a sibling are counted in
    `.siblings_taken`)."""
    runner, K, M, V = (
        engine.executor,
        engine.executor.K,
        engine.executor.M,
        engine.executor.target_cfg.vocab_size,
    )
    rng = random.Random(seed)
    index, requests, pending, steps, checks = {}, {}, list(range(len(prompts))), 0, 0
    # request -> (output length before the step, tokens it must emit)
    expect, siblings_taken = {}, 0
    while pending or engine.has_work:
        while pending and joins[pending[0]] <= steps:
            i = pending.pop(0)
            requests[i] = engine.add_request(prompts[i], params[i] if params else GREEDY)
            index[requests[i].request_id] = i
        for out in engine.step():
            if outputs is not None:
                outputs.setdefault(index[out.request_id], []).append(out)
        steps += 1
        for r in list(engine.scheduler.running.values()):
            if r.is_finished or r.slot is None:
                continue
            i, n = index[r.request_id], len(r.output_ids)
            if r.request_id in expect:
                before, emits = expect.pop(r.request_id)
                assert n - before == emits, f"request {i} after {before} tokens"
            if check_against is not None:
                expected, expected_siblings = fresh_drafts(
                    check_against, prompts[i] + r.output_ids, checks
                )
                assert torch.equal(runner.state.drafts[r.slot, :K], expected), (
                    f"request {i} after {n} tokens"
                )
                assert torch.equal(runner.state.siblings[r.slot, :, :K], expected_siblings), (
                    f"request {i} after {n} tokens"
                )
                checks += 1
            right = (refs[i][n : n + K] + [0] * K)[:K]
            drafts = [
                (d + 1 + rng.randrange(V - 1)) % V if rng.random() < corrupt_p else d for d in right
            ]
            runner.state.drafts[r.slot, :K] = torch.tensor(drafts)
            if M:
                siblings = [[rng.randrange(V) for _ in range(K)] for _ in range(M)]
                for j in range(K):
                    if drafts[j] != right[j] and rng.random() < 0.5:
                        siblings[rng.randrange(M)][j] = right[j]
                runner.state.siblings[r.slot, :, :K] = torch.tensor(siblings)
                j = next((j for j in range(K) if drafts[j] != right[j]), K)
                through = j < K and any(s[j] == right[j] for s in siblings)
                siblings_taken += through
                if n + K + 1 <= len(refs[i]):  # the request does not end within the step
                    expect[r.request_id] = (n, j + 1 + through)
    assert check_against is None or checks > 20
    run_with_oracle.siblings_taken = siblings_taken
    return [requests[i] for i in range(len(prompts))]


@pytest.mark.parametrize("k, siblings", [(1, 0), (3, 0), (5, 0), (1, 1), (3, 1), (4, 2)])
def test_greedy_accepting_drafts_joining_batch(
    tiny_dir, tiny_drafter_dir, prompts, plain_ref, k, siblings
):
    """Drafts accepted and rejected at every depth; with a draft tree, steps that go on through a
    sibling at every depth too (each step's emitted count checked), whose K/V
    the next steps read."""
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir, k=k, max_batch_size=4, overlap=False, draft_siblings=siblings
    )
    requests = run_with_oracle(engine, prompts, plain_ref, JOINS, corrupt_p=0.2)
    assert [r.output_ids for r in requests] == plain_ref
    stats = engine.scheduler.stats
    assert stats.num_draft_accepted > 0.5 * stats.num_draft_proposed  # the accept path really ran
    assert stats.accepted_at[-1] > 0  # ... down to the last draft
    assert (run_with_oracle.siblings_taken > 5) == (siblings > 0)


@pytest.mark.parametrize("sampled, siblings", [(False, 0), (False, 1), (True, 0)])
def test_logprobs_are_the_targets_own(
    tiny_dir, tiny_drafter_dir, prompts, plain_ref, sampled, siblings, monkeypatch
):
    """Every emitted token's log-probability, and the top ones, equal a Hugging Face forward's over
    prompt + output (before temperature, as vLLM reports them): requests joining mid-flight, drafts
    accepted at every depth (greedy, oracle drafts) or sampled rows; so do the prompt's (echo), for
    prompts of different lengths prefilled together; a request that asks for none gets none, and its
    batch neighbours' requests do not change its tokens. (Sampled: the prompt's in chunks of 7
    positions.) With a draft tree, a token after an accepted sibling reports the
    sibling node's logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    counts = [3, None, 0, 5, None, 2, 1]
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir, k=3, max_batch_size=4, overlap=False, draft_siblings=siblings
    )
    outputs = {}
    if sampled:
        monkeypatch.setattr(prompt_logprobs, "__defaults__", (7,))
        params = [
            SamplingParams(
                temperature=0.9,
                top_k=20,
                seed=i,
                max_tokens=24,
                ignore_eos=True,
                logprobs=n,
                prompt_logprobs=n,
            )
            for i, n in enumerate(counts)
        ]
        index, pending, steps = {}, list(range(len(prompts))), 0
        while pending or engine.has_work:
            while pending and JOINS[pending[0]] <= steps:
                i = pending.pop(0)
                index[engine.add_request(prompts[i], params[i]).request_id] = i
            for out in engine.step():
                outputs.setdefault(index[out.request_id], []).append(out)
            steps += 1
    else:
        params = [GREEDY.model_copy(update={"logprobs": n, "prompt_logprobs": n}) for n in counts]
        requests = run_with_oracle(
            engine, prompts, plain_ref, JOINS, corrupt_p=0.2, params=params, outputs=outputs
        )
        assert [r.output_ids for r in requests] == plain_ref
        assert engine.scheduler.stats.accepted_at[-1] > 0
    for i, n in enumerate(counts):
        tokens = [t for out in outputs[i] for t in out.new_token_ids]
        output_logprobs = [lp for out in outputs[i] for lp in (out.logprobs or [])]
        if n is None:
            assert all(out.logprobs is None and out.prompt_logprobs is None for out in outputs[i])
            continue
        assert len(output_logprobs) == len(tokens) > 0
        assert all(out.prompt_logprobs is None for out in outputs[i][1:])
        with torch.no_grad():
            logp = hf(torch.tensor([prompts[i] + tokens])).logits[0].log_softmax(-1)[:-1]
        sequence = torch.tensor(prompts[i] + tokens)[1:]
        for j, got in (
            (slice(len(prompts[i]) - 1, None), output_logprobs),
            (slice(None, len(prompts[i]) - 1), outputs[i][0].prompt_logprobs),
        ):
            torch.testing.assert_close(
                torch.tensor([lp for lp, _ in got]),
                logp[j].gather(-1, sequence[j, None])[:, 0],
                rtol=1e-4,
                atol=1e-4,
            )
            top = logp[j].topk(n, -1)
            assert [[t for t, _ in top_] for _, top_ in got] == top.indices.tolist()
            torch.testing.assert_close(
                torch.tensor([[v for _, v in top_] for _, top_ in got]).view(len(got), n),
                top.values,
                rtol=1e-4,
                atol=1e-4,
            )


def biased(
    logits: torch.Tensor, prompt: list[int], out: list[int], params: SamplingParams
) -> torch.Tensor:
    """OpenAI's logit_bias, vLLM's repetition penalty (over prompt and output) and OpenAI's
    frequency and presence penalties (over the output) on next-token logits [V] after `out`."""
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
    bias = torch.zeros(logits.shape[-1])
    bias[list(params.logit_bias)] = torch.tensor(list(params.logit_bias.values()))
    logits = logits + bias
    for t in set(prompt) | set(out):
        logits[t] = (
            logits[t] / params.repetition_penalty
            if logits[t] > 0
            else logits[t] * params.repetition_penalty
        )
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def penalised_greedy(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with OpenAI's logit_bias and penalties, from Hugging Face logits over
    the whole sequence."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(biased(logits, prompt, out, params).argmax()))
    return out


def assert_resumed_outputs(engine, prompts, params, refs, t: int) -> None:
    """Every request resumed after its first t output tokens, as the server resubmits it (prompt +
    those tokens, what is left of max_tokens and min_tokens), goes on with the rest of its
    reference; one that ended by then is not resumed."""
    live = [i for i, ref in enumerate(refs) if len(ref) > t]
    resumed = [
        params[i].model_copy(
            update={
                "max_tokens": params[i].max_tokens - t,
                "min_tokens": max(0, params[i].min_tokens - t),
                "prior_output_tokens": t,
            }
        )
        for i in live
    ]
    got = run_to_completion(engine, [prompts[i] + refs[i][:t] for i in live], resumed)
    assert [r.output_ids for r in got] == [refs[i][t:] for i in live], t


def test_penalties_and_logit_bias_greedy_equal_the_reference(tiny_dir, tiny_drafter_dir, prompts):
    """Frequency, presence and repetition penalties and logit_bias change greedy output as OpenAI
    (vLLM, for repetition) defines them, and speculative decoding keeps it exact: the verify pass
    penalises position j for drafts 1..j as if accepted (oracle drafts, accepted at every depth), in
    a batch with requests without them. A request resumed after any token (prompt + those tokens)
    counts them as output."""
    params = [
        GREEDY.model_copy(
            update={
                "max_tokens": 24,
                "frequency_penalty": f,
                "presence_penalty": p,
                "logit_bias": b,
                "repetition_penalty": r,
            }
        )
        for f, p, b, r in [
            (0.8, 0.0, {}, 1.0),
            (0.0, 0.0, {}, 1.0),
            (0.0, 1.5, {}, 1.3),
            (0.5, 0.5, {7: 2.5, 30: -100.0}, 1.0),
            (-0.5, 0.0, {}, 0.8),
            (0.0, 0.0, {}, 1.8),
            (0.0, 0.0, {3: 4.0, 11: -1.0, 63: 1.5}, 1.0),
        ]
    ]
    refs = [penalised_greedy(tiny_dir, prompt, p) for prompt, p in zip(prompts, params)]
    plain = [
        penalised_greedy(tiny_dir, prompt, params[1])
        for prompt in (prompts[0], prompts[5], prompts[6])
    ]
    # the penalties and the bias are felt
    assert refs[0] != plain[0] and refs[5] != plain[1] and refs[6] != plain[2]
    engine = tiny_engine(tiny_dir, max_batch_size=4)
    assert [r.output_ids for r in run_to_completion(engine, prompts, params, JOINS)] == refs
    for t in range(1, 24):
        assert_resumed_outputs(engine, prompts, params, refs, t)
    # with a draft tree, a sibling's logits follow the drafts on its own path
    for siblings in (0, 2):
        engine = tiny_engine(
            tiny_dir,
            tiny_drafter_dir,
            k=3,
            max_batch_size=4,
            overlap=False,
            draft_siblings=siblings,
        )
        requests = run_with_oracle(engine, prompts, refs, JOINS, corrupt_p=0.2, params=params)
        assert [r.output_ids for r in requests] == refs
        assert engine.scheduler.stats.accepted_at[-1] > 0
        assert (run_with_oracle.siblings_taken > 5) == (siblings > 0)


def min_tokens_greedy(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding from Hugging Face logits where the stop tokens cannot be chosen before
    min_tokens, ending with the first stop token after (a generated token, as in vLLM)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        if len(out) < params.min_tokens:
            logits[params.stop_token_ids] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in params.stop_token_ids:
            break
    return out


def test_min_tokens_holds_back_stop_tokens(tiny_dir, tiny_drafter_dir, prompts, plain_ref):
    """min_tokens keeps stop tokens from being chosen before it, at every draft depth and sibling
    (the verify pass masks each node by the position it chooses), in a batch with requests without
    it and one that stops at once without it; the output equals a Hugging Face reference. In the
    even rows the stop token is the plain output's token at min_tokens (and not before it), so the
    output ends right at the boundary, often inside a step that began before it."""

    def stop_at(ref, j):
        return next(i for i in range(j, len(ref)) if ref[i] not in ref[:i])

    cases = [(ref, stop_at(ref, 4 + i)) for i, ref in enumerate(plain_ref)]
    params = [
        GREEDY.model_copy(update={"max_tokens": 30, "stop_token_ids": [ref[j]], "min_tokens": j})
        if i % 2 == 0
        else GREEDY.model_copy(
            update={"max_tokens": 30, "stop_token_ids": [ref[2], ref[5]], "min_tokens": m}
        )
        for i, ((ref, j), m) in enumerate(zip(cases, [0, 0, 0, 25, 0, 7, 0]))
    ]
    refs = [min_tokens_greedy(tiny_dir, prompt, p) for prompt, p in zip(prompts, params)]
    assert len(refs[1]) == 3 and len(refs[3]) >= 25  # the stop tokens do stop the output
    assert all(refs[i] == ref[: j + 1] for i, (ref, j) in enumerate(cases) if i % 2 == 0)
    engine = tiny_engine(tiny_dir, max_batch_size=4)
    assert [r.output_ids for r in run_to_completion(engine, prompts, params, JOINS)] == refs
    # resumed after t tokens (as the server resubmits): what is left of min_tokens
    for t in (1, 3, 9):
        assert_resumed_outputs(engine, prompts, params, refs, t)
    for siblings in (0, 1):
        engine = tiny_engine(
            tiny_dir,
            tiny_drafter_dir,
            k=3,
            max_batch_size=4,
            overlap=False,
            draft_siblings=siblings,
        )
        requests = run_with_oracle(engine, prompts, refs, JOINS, corrupt_p=0.2, params=params)
        assert [r.output_ids for r in requests] == refs
        assert engine.scheduler.stats.accepted_at[-1] > 0


def test_min_tokens_ends_with_its_request(tiny_dir, prompts, plain_ref):
    """A slot's next request, prefilled in a step without min_tokens, does not inherit the earlier
    request's, even in later steps beside a new request with min_tokens."""
    stop = next(t for i, t in enumerate(plain_ref[2]) if i >= 3 and t not in plain_ref[2][:i])
    ends = plain_ref[2].index(stop)
    held = GREEDY.model_copy(update={"max_tokens": 20, "min_tokens": 20, "stop_token_ids": [stop]})
    params = [
        held,
        held,
        GREEDY.model_copy(update={"stop_token_ids": [stop]}),
        held.model_copy(update={"max_tokens": 40}),
    ]
    engine = tiny_engine(tiny_dir, max_batch_size=2)
    requests = run_to_completion(engine, prompts[:4], params, [0, 0, 25, 26])
    assert requests[2].output_ids == plain_ref[2][: ends + 1]
    assert requests[2].finish_reason == "stop"


@pytest.mark.parametrize("k, siblings", [(1, 0), (3, 0), (3, 1)])
def test_drafter_kv_cache_matches_fresh_prefill(
    tiny_dir, tiny_drafter_dir, prompts, plain_ref, k, siblings
):
    """After any mix of accepted and rejected drafts (and siblings), the drafter's KV cache holds
    what a fresh prefill of the accepted tokens would: its next proposals are
    identical, siblings too."""
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir, k=k, max_batch_size=4, overlap=False, draft_siblings=siblings
    )
    fresh = ModelRunner(engine.cfg)
    requests = run_with_oracle(
        engine, prompts[:4], plain_ref[:4], JOINS[:4], corrupt_p=0.3, check_against=fresh
    )
    assert [r.output_ids for r in requests] == plain_ref[:4]


@pytest.mark.parametrize("k, siblings", [(1, 0), (3, 0), (3, 2)])
def test_whole_decode_step_function(tiny_dir, tiny_drafter_dir, prompts, plain_ref, k, siblings):
    """What `graph_first_draft` captures as one graph (verify, first draft, draft forwards 2..K),
    run eagerly: lossless, and the drafts it leaves equal a fresh prefill's, through accepted and
    rejected drafts and steps that mix prefills (drafted apart) with decodes."""
    engine = tiny_engine(
        tiny_dir,
        tiny_drafter_dir,
        k=k,
        max_batch_size=4,
        overlap=False,
        graph_first_draft=True,
        draft_siblings=siblings,
    )
    graphs = replay_graphs_on_cpu(engine.executor, "verify").verify
    fresh = ModelRunner(engine.cfg)
    requests = run_with_oracle(
        engine, prompts[:4], plain_ref[:4], JOINS[:4], corrupt_p=0.3, check_against=fresh
    )
    assert [r.output_ids for r in requests] == plain_ref[:4]
    assert graphs.replays > 10


@pytest.mark.parametrize("k", [None, 1, 3])  # None: plain decoding
def test_every_step_graph_replayed_on_cpu(tiny_dir, tiny_drafter_dir, prompts, plain_ref, k):
    """The whole graph set a GPU engine captures (prefill, verify, draft chain), each replayed
    by its real StepGraphs (bucketing, padding) running the function eagerly: plain decoding's
    tokens with requests joining mid-flight."""
    drafter = "none" if k is None else tiny_drafter_dir
    engine = tiny_engine(tiny_dir, drafter, k=k or 3, max_batch_size=4)
    runner = engine.executor
    replay_graphs_on_cpu(runner)
    requests = run_to_completion(engine, prompts, GREEDY, JOINS)
    assert [r.output_ids for r in requests] == plain_ref
    used = [runner.graphs.prefill, runner.graphs.verify] + [runner.graphs.chain] * ((k or 0) > 1)
    assert all(graphs.replays > 0 for graphs in used)


@pytest.mark.parametrize("siblings", [None, 0, 2])
def test_eager_verification_after_the_graphed_target_pass(
    tiny_dir, tiny_drafter_dir, prompts, siblings
):
    """Steps that verify eagerly (sampled, logprobs, penalties, logit_bias) replay the target pass's
    graph where one fits and run only the verification eager: the same tokens as all-eager steps,
    with the pass's batch padded as a graph pads it. (None: plain decoding.)"""
    params = [
        SamplingParams(
            temperature=0.9,
            seed=i,
            max_tokens=20,
            ignore_eos=True,
            logprobs=2 if i % 2 else None,
            frequency_penalty=0.4 * (i % 3),
            logit_bias={5: 1.5} if i == 3 else {},
        )
        for i in range(len(prompts))
    ]
    drafter = "none" if siblings is None else tiny_drafter_dir
    outputs = []
    for graphed in (False, True):
        engine = tiny_engine(tiny_dir, drafter, k=3, max_batch_size=4, draft_siblings=siblings or 0)
        runner = engine.executor
        if graphed:
            replay_graphs_on_cpu(runner, "target_pass")
        outputs.append([r.output_ids for r in run_to_completion(engine, prompts, params, JOINS)])
    assert outputs[0] == outputs[1]
    assert runner.graphs.target_pass.replays > 10


# ---- greedy, real SmolLM2 ----


@pytest.mark.parametrize("k, num_prompts, max_tokens", [(1, 1, 40), (3, 6, 64), (5, 1, 40)])
def test_greedy_smollm2(
    smollm2_prompts, smollm2_greedy_64, smollm2_near_tie, k, num_prompts, max_tokens
):
    from conftest import _smollm2

    engine = _smollm2("default", num_draft_tokens=k, max_batch_size=4)
    prompts = smollm2_prompts[:num_prompts]
    params = SamplingParams(max_tokens=max_tokens)
    joins = [0, 0, 2, 5, 9, 14][:num_prompts]
    requests = run_to_completion(engine, prompts, params, joins)
    for prompt, r, ref in zip(prompts, requests, smollm2_greedy_64):
        smollm2_near_tie(prompt, r.output_ids, ref[:max_tokens])


def test_greedy_smollm2_trained_drafter(smollm2_prompts, smollm2_greedy_64, smollm2_near_tie):
    from speculative.drafter_format import DEFAULT_DRAFTERS

    trained = DEFAULT_DRAFTERS["smollm2-135m"]
    if not (trained / "config.json").is_file():
        pytest.skip("no trained drafter at speculative/drafters/smollm2-135m yet")
    from conftest import _smollm2

    tokens_per_step = []
    # the chain, then the draft tree: still exact, and more tokens per target pass
    for siblings in (0, 1):
        engine = _smollm2("default", num_draft_tokens=3, max_batch_size=8, draft_siblings=siblings)
        requests = run_to_completion(
            engine, smollm2_prompts[:8], SamplingParams(max_tokens=64), [0, 0, 0, 1, 2, 4, 8, 12]
        )
        for prompt, r, ref in zip(smollm2_prompts, requests, smollm2_greedy_64):
            smollm2_near_tie(prompt, r.output_ids, ref)
        stats = engine.scheduler.stats
        tokens_per_step.append(1 + stats.num_draft_accepted / stats.num_verify_rows)
    assert 1.5 < tokens_per_step[0] < tokens_per_step[1] - 0.1, tokens_per_step


# ---- sampling: the distribution of the first three tokens ----

V16, PROMPT, NUM_SAMPLES = 16, [3, 1, 4, 1, 5, 9, 2, 6], 3000


@pytest.fixture(scope="module")
def v16_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("v16")
    target = write_tiny_llama(
        root / "target",
        vocab_size=V16,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        seed=5,
        std=0.15,
    )
    return target, write_random_drafter(root / "drafter", target, seed=6)


def reference_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Written independently of speculative.verify: temperature, then min-p (tokens at least min_p x
    the likeliest one's probability), then top-k, then top-p on the renormalised survivors (the
    smallest set of most likely tokens whose mass reaches top_p)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    out = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        ranked = [
            t
            for t in probs[row].argsort(descending=True).tolist()
            if probs[row, t] >= min_p * probs[row].max()
        ]
        ranked = ranked[: top_k if top_k > 0 else None]
        mass, total = 0.0, probs[row, ranked].sum().item()
        for token in ranked:
            if mass >= top_p:
                break
            out[row, token] = probs[row, token]
            mass += probs[row, token].item() / total
    return out / out.sum(-1, keepdim=True)


def test_logit_bias_ends_with_its_request(tiny_dir, prompts):
    """A slot's next request does not inherit its bias, even when it is prefilled in a step without
    biased rows and then decodes beside a new biased request."""
    strong = GREEDY.model_copy(update={"max_tokens": 2, "logit_bias": {5: 100.0}})
    plain = GREEDY.model_copy(update={"max_tokens": 20})
    joined = GREEDY.model_copy(update={"max_tokens": 20, "logit_bias": {9: 100.0}})
    engine = tiny_engine(tiny_dir, max_batch_size=2)
    requests = run_to_completion(engine, prompts[:4], [strong, strong, plain, joined], [0, 0, 6, 9])
    assert requests[0].output_ids == [5, 5] and requests[3].output_ids == [9] * 20
    assert requests[2].output_ids == penalised_greedy(tiny_dir, prompts[2], plain)


def exact_joint(model_dir, params: SamplingParams, prompt=PROMPT):
    """P(t1, t2, t3) [V, V, V] and the conditionals, from a Hugging Face forward of every prefix
    (with OpenAI's logit_bias and penalties)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def next_probs(prefixes):
        ids = torch.tensor([prompt + p for p in prefixes])
        with torch.no_grad():
            logits = torch.stack(
                [biased(row, prompt, p, params) for row, p in zip(hf(ids).logits[:, -1], prefixes)]
            )
            return reference_probs(
                logits, params.temperature, params.top_k, params.top_p, params.min_p
            )

    p1 = next_probs([[]])[0]  # [V]
    p2 = next_probs([[a] for a in range(V16)])  # [V, V]
    p3 = next_probs([[a, b] for a in range(V16) for b in range(V16)]).view(V16, V16, V16)
    return p1[:, None, None] * p2[:, :, None] * p3, (p2, p3)


def oracle_drafts(
    conditionals, history: list[int], k: int, m: int = 0
) -> tuple[list[int], list[list[int]]]:
    """Drafts that depend only on the history: the most likely next tokens under the exact tables
    (so they have large p and get accepted often), and as siblings at each depth the next m most
    likely there; beyond the third token anything will do. -> (drafts [k], siblings [m][k])."""
    p2, p3 = conditionals
    drafts, siblings, h = [], [[] for _ in range(m)], list(history)
    for _ in range(k):
        p = p2[h[0]] if len(h) == 1 else p3[h[0], h[1]] if len(h) == 2 else None
        ranked = p.argsort(descending=True).tolist() if p is not None else [0] * (m + 1)
        drafts.append(ranked[0])
        for j in range(m):
            siblings[j].append(ranked[j + 1])
        h.append(ranked[0])
    return drafts, siblings


def sample_first_three(
    engine, params: SamplingParams, conditionals=None, prompt=PROMPT, after_step=None, per_seed=None
) -> torch.Tensor:
    """NUM_SAMPLES requests of the same prompt with seeds 0.. -> counts of (t1, t2, t3) [V, V, V].
    after_step(requests) runs after every step; per_seed(seed) -> more parameters of that one."""
    runner, K = engine.executor, engine.executor.K
    updates = [{"seed": s} | (per_seed(s) if per_seed else {}) for s in range(NUM_SAMPLES)]
    requests = [engine.add_request(prompt, params.model_copy(update=u)) for u in updates]
    while engine.has_work:
        engine.step()
        if after_step is not None:
            after_step(requests)
        if conditionals is not None:
            live = [
                r
                for r in engine.scheduler.running.values()
                if not r.is_finished and r.slot is not None
            ]
            if live:
                slots = torch.tensor([r.slot for r in live])
                oracles = [oracle_drafts(conditionals, r.output_ids, K, runner.M) for r in live]
                runner.state.drafts[slots, :K] = torch.tensor([d for d, _ in oracles])
                if runner.M:
                    runner.state.siblings[slots, :, :K] = torch.tensor([s for _, s in oracles])
    counts = torch.zeros(V16, V16, V16)
    for r in requests:
        assert len(r.output_ids) == 3
        counts[tuple(r.output_ids)] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """Pearson chi-square of the observed (t1, t2, t3) counts against the exact joint; cells with
    expected count below 5 are pooled into one."""
    expected = (joint * counts.sum()).flatten().double()
    observed = counts.flatten().double()
    if observed[expected == 0].sum() > 0:
        return 0.0  # an impossible outcome was produced
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().view(1)])
    o = torch.cat([observed[big], observed[~big].sum().view(1)])
    if e[-1] == 0:
        e, o = e[:-1], o[:-1]
    stat = ((o - e) ** 2 / e).sum().item()
    return float(chi2.sf(stat, df=len(e) - 1))


SAMPLING = {
    "t1": SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    "t0.7-topk5-topp0.9": SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, max_tokens=3, ignore_eos=True
    ),
    "t1-minp0.2-topp0.9": SamplingParams(
        temperature=1.0, min_p=0.2, top_p=0.9, max_tokens=3, ignore_eos=True
    ),
    # repeats made likely, so that the penalties are felt often
    "t1-penalties-bias": SamplingParams(
        temperature=1.0,
        max_tokens=3,
        ignore_eos=True,
        frequency_penalty=-1.5,
        presence_penalty=-1.0,
        repetition_penalty=0.7,
        logit_bias={2: 1.5, 9: -2.0},
    ),
}


def _engine(dirs, drafter: bool, k: int, prompt_lookup: float = 0.0, siblings: int = 0):
    target, drafter_dir = dirs
    return tiny_engine(
        target,
        drafter_dir if drafter else "none",
        k=k,
        max_batch_size=500,
        max_model_len=32,
        max_num_batched_tokens=4096,
        overlap=False,
        prompt_lookup=prompt_lookup,
        draft_siblings=siblings,
    )


@pytest.mark.parametrize(
    "params_name, drafts, k, siblings",
    [
        ("t1", "none", 0, 0),
        ("t1", "random", 3, 0),
        ("t1", "oracle", 1, 0),
        ("t1", "oracle", 3, 0),
        ("t0.7-topk5-topp0.9", "oracle", 3, 0),
        ("t1-minp0.2-topp0.9", "oracle", 3, 0),
        ("t1-penalties-bias", "none", 0, 0),
        ("t1-penalties-bias", "oracle", 3, 0),
        ("t1", "oracle", 3, 2),
        ("t0.7-topk5-topp0.9", "oracle", 2, 1),
        ("t1-penalties-bias", "oracle", 3, 1),
    ],
)
def test_sampled_distribution_matches_target(v16_dirs, params_name, drafts, k, siblings):
    """The exact joint of the first three tokens; with a draft tree, the oracle's siblings are the
    next most likely tokens at each depth, so that they are accepted often."""
    params = SAMPLING[params_name]
    joint, conditionals = exact_joint(v16_dirs[0], params)
    engine = _engine(v16_dirs, drafts != "none", max(k, 1), siblings=siblings)
    counts = sample_first_three(engine, params, conditionals if drafts == "oracle" else None)
    p_value = chi2_pvalue(counts, joint)
    print(f"chi-square p-value {p_value:.3g}")
    assert p_value > 1e-3
    if drafts == "oracle":
        stats = engine.scheduler.stats
        # drafts carry real probability mass
        assert stats.accepted_at[0] > 0.3 * stats.num_verify_rows


def accept_always(probs, drafts, u_accept, u_sample, *_):
    """WRONG: every draft accepted, the bonus drawn from p after the last draft."""
    B, K = drafts.shape
    from speculative.sampling import sample

    bonus = sample(probs[:, K], u_sample[:, K])
    return (
        torch.cat([drafts, bonus.unsqueeze(1)], 1),
        torch.full((B,), K + 1, dtype=torch.long),
        chain_path(B, K, "cpu"),
    )


def resample_without_removal(probs, drafts, u_accept, u_sample, *_):
    """WRONG: accept with probability p(x) but, on rejection, redraw from p
    itself (x not removed)."""
    from speculative.sampling import sample

    B, K = drafts.shape
    p_draft = probs[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accepted = (u_accept < p_draft).int().cumprod(-1).sum(-1)
    rows = torch.arange(B)
    bonus = sample(probs[rows, accepted], u_sample[rows, accepted])
    padded = torch.cat([drafts, bonus.unsqueeze(1)], dim=1)
    tokens = torch.where(torch.arange(K + 1) < accepted.unsqueeze(1), padded, bonus.unsqueeze(1))
    return tokens, accepted + 1, chain_path(B, K, "cpu")


def siblings_too_often(probs, drafts, u_accept, u_sample, siblings, u_sibling, limit=None):
    """WRONG: a sibling accepted twice as often as its probability says."""
    return verify_sampled(probs, drafts, u_accept, u_sample, siblings, u_sibling * 0.5, limit)


@pytest.mark.parametrize(
    "wrong_rule, siblings",
    [(accept_always, 0), (resample_without_removal, 0), (siblings_too_often, 1)],
)
def test_wrong_acceptance_rule_is_caught(v16_dirs, monkeypatch, wrong_rule, siblings):
    import speculative.verify

    monkeypatch.setattr(speculative.verify, "verify_sampled", wrong_rule)
    params = SAMPLING["t1"]
    joint, conditionals = exact_joint(v16_dirs[0], params)
    counts = sample_first_three(_engine(v16_dirs, True, 3, siblings=siblings), params, conditionals)
    p_value = chi2_pvalue(counts, joint)
    print(f"chi-square p-value {p_value:.3g}")
    assert p_value < 1e-6


# ---- prompt lookup in the draft chain ----


def python_lookup(seq: list[int], n: int = 5):
    """The token after the latest earlier occurrence of the last n tokens of seq, or None."""
    tail = seq[-n:]
    for end in range(len(seq) - 2, n - 2, -1):
        if seq[end - n + 1 : end + 1] == tail:
            return seq[end + 1]
    return None


def check_looked_up_drafts(engine, requests) -> int:
    """Each running request's chain drafts against the plain-Python lookup over its tokens and the
    drafts before it, wherever that finds a match (prompt_lookup 1.0: lookup then always wins, as a
    random drafter's probability of its own draft is far below 1). -> the number checked."""
    checked = 0
    for r in requests:
        if r.slot is None or r.is_finished or not r.output_ids:
            continue
        seq = r.prompt_ids + r.output_ids
        for draft in engine.executor.state.drafts[r.slot, : engine.executor.K].tolist():
            expected = python_lookup(seq)
            if expected is not None:
                assert draft == expected
                checked += 1
            seq = seq + [draft]
    return checked


def test_lookup_finds_the_latest_earlier_occurrence():
    from speculative.prompt_lookup import lookup

    history = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 5, 6, 0, 0, 0]] * 3)
    found, token = lookup(history, torch.tensor([7, 4, 2]), n=2)
    # q=7: the pair (5, 6) at positions 7-8 last occurred at 4-5, followed by 9; q=4: the pair
    # itself at 4-5 does not count, its earlier occurrence at 0-1 is followed
    # by 7; q=2: (7, 8) is new
    assert found.tolist() == [True, True, False] and token[:2].tolist() == [9, 7]
    history = torch.tensor([[1, 5, 6, 7, 2, 5, 6, 8, 1, 5, 6, 0, 0]] * 2)
    found, token = lookup(history, torch.tensor([9, 0]), n=3)
    assert found.tolist() == [True, False] and token[0] == 7  # (1, 5, 6), not the later (2, 5, 6)
    seq = history[0, :11].tolist()
    assert python_lookup(seq, 3) == 7 and python_lookup(seq, 2) == 8


def test_sampled_distribution_with_prompt_lookup(v16_dirs):
    """Looked-up drafts depend on sampled tokens (the history), yet the output keeps the target's
    distribution. The prompt repeats itself (its last eight tokens occur earlier), and its likeliest
    first token (p 0.75) continues the repeat, so most chains are looked up; each looked-up draft is
    checked against the plain-Python lookup. (A request of three tokens runs too few steps to catch
    an unrecorded token: the greedy test below holds the recording.)"""
    prompt, K = [3, 1, 2, 7, 3, 1, 13, 9] * 2 + [3, 1], 3
    params = SAMPLING["t1"]
    joint, _ = exact_joint(v16_dirs[0], params, prompt)
    engine = _engine(v16_dirs, True, K, prompt_lookup=1.0)
    checked = []
    counts = sample_first_three(
        engine,
        params,
        prompt=prompt,
        after_step=lambda requests: checked.append(check_looked_up_drafts(engine, requests)),
    )
    p_value = chi2_pvalue(counts, joint)
    print(f"chi-square p-value {p_value:.3g}, {sum(checked)} looked-up drafts")
    assert p_value > 1e-3
    assert sum(checked) > NUM_SAMPLES


@pytest.mark.parametrize("k, siblings", [(1, 0), (3, 0), (3, 1)])
def test_greedy_prompt_lookup_joining_batch(
    tiny_dir, tiny_drafter_dir, prompts, plain_ref, k, siblings
):
    """Drafts taken from earlier in the request change what is verified, never what is emitted."""
    engine = tiny_engine(
        tiny_dir,
        tiny_drafter_dir,
        k=k,
        max_batch_size=4,
        prompt_lookup=1.0,
        draft_siblings=siblings,
    )
    requests = run_to_completion(engine, prompts, GREEDY, JOINS)
    assert [r.output_ids for r in requests] == plain_ref


@pytest.mark.parametrize("siblings", [0, 1])
def test_prompt_lookup_drafts_follow_the_request(tiny_dir, tiny_drafter_dir, prompts, siblings):
    """After every step, each draft in the chain is the token that followed the latest earlier
    occurrence of the five tokens before it (prompt, emitted tokens, the chain's own earlier drafts)
    wherever there is one: what the slot's token history must hold, through prefill, verification,
    rejected drafts, tokens emitted through a sibling and slots reused by joining requests."""
    K = 3
    engine = tiny_engine(
        tiny_dir,
        tiny_drafter_dir,
        k=K,
        max_batch_size=3,
        prompt_lookup=1.0,
        overlap=False,
        draft_siblings=siblings,
    )
    # repeated spans, so that lookups find something in the prompt as well as in the output (where
    # the random target's greedy output falls into loops, more of them the longer it runs)
    long_greedy = GREEDY.model_copy(update={"max_tokens": 120})
    requests = [engine.add_request(p + p[:6] + p, long_greedy) for p in prompts]
    checked = 0
    while engine.has_work:
        engine.step()
        checked += check_looked_up_drafts(engine, requests)
    print(f"{checked} looked-up drafts")
    assert checked >= 10
