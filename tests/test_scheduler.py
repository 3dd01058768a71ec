"""The scheduler through the engine on tiny random targets: continuous batching, per-request
sampling parameters, stop conditions, rejection of bad requests, the extra pass and
the overlapped loop."""

import shutil

import numpy as np
import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts, write_tiny_llama
from pydantic import ValidationError

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.request import RequestError
from speculative.engine.scheduler import Scheduler
from speculative.plan import StepResult

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def recording(engine) -> list:
    """Record every plan the engine sends (the executor itself is untouched)."""
    plans, execute = [], engine.executor.execute
    engine.executor.execute = lambda plan: plans.append(plan) or execute(plan)
    return plans


def solo_outputs(engine, prompts, params) -> list[list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [run_to_completion(engine, [p], sp)[0].output_ids for p, sp in zip(prompts, params)]


# ---- continuous batching ----


@pytest.mark.parametrize("drafter", ["none", "drafter"])
def test_continuous_batching(tiny_dir, tiny_drafter_dir, drafter):
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir if drafter == "drafter" else "none", max_batch_size=3
    )
    prompts = tiny_prompts(8, seed=21)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 17, 9, 2, 12, 6, 20, 1)]
    plans = recording(engine)
    requests = run_to_completion(engine, prompts, params, [0, 0, 0, 1, 1, 5, 6, 9])
    assert [len(r.output_ids) for r in requests] == [4, 17, 9, 2, 12, 6, 20, 1]
    assert all(r.finish_reason == "length" for r in requests)
    assert max(len(p.slots) for p in plans) == 3  # the batch fills up, never beyond
    assert any(p.prefills and p.decode_slots for p in plans)  # requests join a running batch
    prefilled = [row.slot for p in plans for row in p.prefills]
    assert len(prefilled) == 8 and set(prefilled) == {0, 1, 2}  # ... into slots others left
    assert [r.output_ids for r in requests] == solo_outputs(tiny_engine(tiny_dir), prompts, params)


def test_kv_length_near_max_model_len(tiny_dir):
    """A request that runs right up to max_model_len (not a multiple of the 64-row kv rounding)."""
    prompt = tiny_prompts(1, seed=2, min_len=60, max_len=60)[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    short = run_to_completion(tiny_engine(tiny_dir, k=3, max_model_len=100), [prompt], params)[0]
    roomy = run_to_completion(tiny_engine(tiny_dir, k=3, max_model_len=256), [prompt], params)[0]
    assert len(short.output_ids) == 40 and short.output_ids == roomy.output_ids


# ---- per-request sampling parameters ----


def sampled(seed, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, **kw)


@pytest.mark.parametrize("drafter", ["none", "drafter"])
def test_seeds_reproduce_across_batches(tiny_dir, tiny_drafter_dir, drafter):
    """Same seed -> same output, whatever else shares the batch and whenever it joins; different
    seeds differ; greedy requests in a sampled batch still get the greedy output."""
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir if drafter == "drafter" else "none", max_batch_size=4
    )
    prompt = tiny_prompts(1, seed=5)[0]
    alone = run_to_completion(engine, [prompt], sampled(7))[0].output_ids
    others = tiny_prompts(4, seed=6)
    params = [sampled(3), sampled(7), GREEDY, sampled(7), sampled(8)]
    requests = run_to_completion(
        engine, others[:2] + [prompt] * 3, [sampled(1), sampled(2)] + params[2:], [0, 0, 0, 2, 5]
    )
    assert (
        requests[3].output_ids == alone
        and requests[2].output_ids == solo_outputs(engine, [prompt], GREEDY)[0]
    )
    assert requests[4].output_ids != alone
    seeds = {tuple(run_to_completion(engine, [prompt], sampled(s))[0].output_ids) for s in range(6)}
    assert len(seeds) == 6


def reference_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_top_k_top_p_temperature(tiny_dir, tiny_drafter_dir):
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, max_batch_size=8)
    prompt = tiny_prompts(1, seed=12)[0]
    greedy = solo_outputs(engine, [prompt], GREEDY)[0]
    params = (
        [sampled(s, top_k=1) for s in range(3)]
        + [sampled(s, top_p=1e-6) for s in range(3)]
        + [SamplingParams(temperature=0.01, seed=4, max_tokens=16, ignore_eos=True)]
        + [sampled(s, top_k=3) for s in range(8)]
    )
    requests = run_to_completion(engine, [prompt] * len(params), params)
    for r in requests[:7]:
        assert r.output_ids == greedy  # top-k 1, a tiny top-p and a tiny temperature are greedy
    top3_outputs = [r.output_ids for r in requests[7:]]
    assert len({tuple(o) for o in top3_outputs}) > 1
    for out in top3_outputs:  # every token among the target's top three given its prefix
        logits = reference_logits(engine.executor.cfg.model, prompt + out)
        for i, token in enumerate(out):
            assert token in logits[len(prompt) - 1 + i].topk(3).indices.tolist()


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens(tiny_dir, tiny_drafter_dir, max_tokens):
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=5)
    requests = run_to_completion(
        engine,
        tiny_prompts(3, seed=max_tokens),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    assert all(len(r.output_ids) == max_tokens and r.finish_reason == "length" for r in requests)


@pytest.mark.parametrize("overlap", [True, False])
def test_eos(tmp_path, tiny_dir, tiny_drafter_dir, overlap):
    """The same weights with an EOS id the greedy output reaches at step j: output ends with
    it."""
    prompt = tiny_prompts(1, seed=13)[0]
    full = solo_outputs(
        tiny_engine(tiny_dir), [prompt], SamplingParams(max_tokens=30, ignore_eos=True)
    )[0]
    j = len(full) // 2
    while full[j] in full[:j]:
        j += 1
    eos_dir = write_tiny_llama(tmp_path / "eos", eos_token_id=full[j])
    for engine in (
        tiny_engine(eos_dir, overlap=overlap),
        tiny_engine(eos_dir, tiny_drafter_dir, overlap=overlap),
    ):
        r = run_to_completion(engine, [prompt], SamplingParams(max_tokens=30))[0]
        assert r.output_ids == full[: j + 1] and r.finish_reason == "stop"  # EOS kept
        r = run_to_completion(engine, [prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        assert r.output_ids == full and r.finish_reason == "length"
    # stop_token_ids: the same end for that token, per request and whatever ignore_eos says
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, overlap=overlap)
    stopped, other = run_to_completion(
        engine,
        [prompt, prompt],
        [
            SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[full[j]]),
            SamplingParams(max_tokens=30, ignore_eos=True),
        ],
    )
    assert (
        stopped.output_ids == full[: j + 1]
        and stopped.finish_reason == "stop"
        and other.output_ids == full
    )


# ---- stop strings (a tiny target with the SmolLM2 vocabulary and tokenizer) ----


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, smollm2_dir):
    d = write_tiny_llama(
        tmp_path_factory.mktemp("tok") / "m",
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        seed=4,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, d / name)
    return d


def test_stop_strings(tok_dir):
    engine = tiny_engine(tok_dir, max_batch_size=4)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    free = run_to_completion(engine, [prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = engine.tokenizer.decode(free.output_ids, skip_special_tokens=True)
    assert free.text == text and len(text) > 40
    at = len(text) // 2
    stop = text[at : at + 3]
    first = text.find(stop)
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=40, ignore_eos=True, stop=["\x00never", stop]),
    ]
    for r in run_to_completion(engine, [prompt, prompt], params):
        assert r.text == text[:first] and r.finish_reason == "stop"
        decoded = engine.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        assert stop in decoded and stop not in engine.tokenizer.decode(
            r.output_ids[:-1], skip_special_tokens=True
        )


@pytest.mark.parametrize(
    "stop, expected",
    [("four", " one two three "), ("hree fo", " one two t"), ("e f", " one two thre")],
)
def test_stop_string_cut_is_independent_of_tokens_per_step(tok_dir, stop, expected):
    """Speculation emits several tokens a step; a stop string inside them must end the output at the
    same token as plain decoding (one token a step). The streamed deltas never hold the start of a
    stop string that the next tokens complete (here it spans tokens). Scheduler state machine, fed
    by hand."""
    from workers.models.loader import load_tokenizer

    tokenizer = load_tokenizer(tok_dir)
    stream = tokenizer.encode(" one two three four five six seven eight nine ten eleven twelve")
    params = SamplingParams(max_tokens=40, stop=[stop])
    outputs = []
    for per_step in (1, 4):
        s = Scheduler(2, 256, 256, per_step - 1, {0}, tokenizer)
        r = s.add("r", [1, 2, 3], params)
        fed, deltas = 0, []
        while not r.is_finished:
            plan = s.plan()
            n = 1 if plan.prefills else per_step
            tokens = torch.zeros(1, per_step, dtype=torch.long)
            tokens[0, :n] = torch.tensor(stream[fed : fed + n])
            deltas += [
                out.text_delta
                for out in s.process(
                    plan, StepResult(plan.step_id, tokens.numpy(), torch.tensor([n]).numpy())
                )
            ]
            fed += n
        outputs.append((r.output_ids, r.text, r.finish_reason, "".join(deltas)))
    assert outputs[0] == outputs[1]
    assert outputs[0][1:] == (expected, "stop", expected)


@pytest.mark.parametrize("ends_on", ["eos", "length"])
def test_held_back_text_is_sent_when_the_request_ends(tok_dir, ends_on):
    """Text held back because it may begin a stop string is sent once the request ends without it:
    on EOS, a step that adds no text, or on max_tokens."""
    from workers.models.loader import load_tokenizer

    tokenizer = load_tokenizer(tok_dir)
    stream = tokenizer.encode(" one two") + (
        [0] if ends_on == "eos" else tokenizer.encode(" three")
    )
    s = Scheduler(2, 256, 256, 0, {0}, tokenizer)
    r = s.add("r", [1, 2, 3], SamplingParams(max_tokens=len(stream), stop=["two three four"]))
    deltas = []
    for token in stream:
        plan = s.plan()
        deltas += [
            out.text_delta
            for out in s.process(plan, StepResult(plan.step_id, np.array([[token]]), np.array([1])))
        ]
    expected = " one two" if ends_on == "eos" else " one two three"
    assert r.finish_reason == ("stop" if ends_on == "eos" else "length")
    # "two" was held back
    assert "".join(deltas) == expected and deltas[-1] == expected[len(" one ") :]


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        (" one two three four five six", "hree fo", " one two t"),  # a stop string across tokens
        # held back, never stops
        (" Grüße aus Köln! 東京タワー 🚀 ok", "タワー🚀", " Grüße aus Köln! 東京タワー 🚀 ok"),
    ],
)
def test_resumed_request_goes_on_from_the_sent_text(tok_dir, text, stop, expected):
    """A request resumed after any token (on another replica: prompt + the tokens sent, and how much
    of their text the client has) ends where the undisturbed request ends, stop strings spanning the
    resume point included, and the client's text adds up to the same, with what the first engine
    held back (a possible stop string's start, part of a UTF-8 character) sent by the second."""
    from workers.models.loader import load_tokenizer

    tokenizer = load_tokenizer(tok_dir)
    stream = tokenizer.encode(text)
    params = SamplingParams(max_tokens=len(stream), stop=[stop])

    def feed(s, r, tokens):
        deltas = []
        for token in tokens:
            if r.is_finished:
                break
            plan = s.plan()
            deltas += [
                out.text_delta
                for out in s.process(
                    plan, StepResult(plan.step_id, np.array([[token]]), np.array([1]))
                )
            ]
        return "".join(deltas)

    s = Scheduler(1, 256, 256, 0, {0}, tokenizer)
    whole = s.add("r", [1, 2, 3], params)
    assert feed(s, whole, stream) == expected
    for t in range(1, len(whole.output_ids)):
        s = Scheduler(1, 256, 256, 0, {0}, tokenizer)
        first = s.add("r", [1, 2, 3], params)
        shown = feed(s, first, stream[:t])
        assert not first.is_finished
        s = Scheduler(1, 256, 256, 0, {0}, tokenizer)
        resumed = s.add(
            "r",
            [1, 2, 3] + stream[:t],
            params.model_copy(
                update={
                    "max_tokens": len(stream) - t,
                    "prior_output_tokens": t,
                    "prior_text_sent": len(shown),
                }
            ),
        )
        assert shown + feed(s, resumed, stream[t:]) == expected, t
        assert (stream[:t] + resumed.output_ids, resumed.finish_reason) == (
            whole.output_ids,
            whole.finish_reason,
        )


def test_incremental_detokenizing_equals_whole_decode(tok_dir):
    """Deltas decoded from a few tokens of context add up to the whole output's decode, whatever
    the tokens per step, through multi-byte characters split across tokens and steps."""
    import random

    from workers.models.loader import load_tokenizer

    tokenizer = load_tokenizer(tok_dir)
    text = "Grüße aus Köln! 東京タワー 🚀🎉 naïve café, 42 × 7 = 294. \n\tDone: 😀 ok"
    stream = tokenizer.encode(text)
    for seed in range(4):
        rng = random.Random(seed)
        s = Scheduler(1, 512, 512, 3, {tokenizer.eos_token_id}, tokenizer)
        r = s.add("r", [1, 2, 3], SamplingParams(max_tokens=len(stream), ignore_eos=True))
        fed, deltas = 0, []
        while not r.is_finished:
            plan = s.plan()
            n = 1 if plan.prefills else min(rng.randint(1, 4), len(stream) - fed)
            tokens = torch.zeros(1, 4, dtype=torch.long)
            tokens[0, :n] = torch.tensor(stream[fed : fed + n])
            for out in s.process(
                plan, StepResult(plan.step_id, tokens.numpy(), torch.tensor([n]).numpy())
            ):
                deltas.append(out.text_delta)
            fed += n
        assert (
            "".join(deltas) == r.text == tokenizer.decode(stream, skip_special_tokens=True) == text
        )


# ---- bad requests ----


def test_bad_requests_are_rejected_and_harm_no_other(tiny_dir, tiny_drafter_dir):
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, max_model_len=64, max_batch_size=4)
    prompts = tiny_prompts(4, seed=30)
    params = [GREEDY, sampled(1), GREEDY, sampled(2)]
    ref = [
        r.output_ids
        for r in run_to_completion(
            tiny_engine(tiny_dir, tiny_drafter_dir, max_model_len=64, max_batch_size=4),
            prompts,
            params,
        )
    ]
    requests = [
        engine.add_request(prompts[0], params[0]),
        engine.add_request(prompts[1], params[1], "dup"),
    ]
    engine.step()
    bad = [
        ([1] * 60, GREEDY, "exceeds the maximum sequence length"),
        ([], GREEDY, "empty"),
        ([1, 2, 64], GREEDY, "token id 64 is outside the vocabulary"),
        ([1, -1], GREEDY, "token id -1 is outside the vocabulary"),
        ([1, 2], SamplingParams(stop=["x"], max_tokens=4), "stop strings need a tokenizer"),
    ]
    for prompt, sp, message in bad:
        with pytest.raises(RequestError, match=message):
            engine.add_request(prompt, sp)
        engine.step()
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request(prompts[2], GREEDY, "dup")
    requests += [
        engine.add_request(prompts[2], params[2]),
        engine.add_request(prompts[3], params[3]),
    ]
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in requests] == ref


def test_auto_ids_pass_over_a_callers_ids(tiny_dir):
    engine = tiny_engine(tiny_dir)
    mine = engine.add_request([1, 2], GREEDY, "req-0")
    auto = [engine.add_request([1, 2], GREEDY) for _ in range(2)]
    assert [r.request_id for r in auto] == ["req-1", "req-2"] and mine.request_id == "req-0"


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 5.0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("max_tokens", 0),
        ("seed", -1),
        ("stop", [""]),
        ("stop", ["a"] * 1025),
        ("bogus", 1),
        ("min_tokens", -1),
        ("min_tokens", 300),
        ("repetition_penalty", 0.0),
    ],
)
def test_invalid_sampling_params(field, value):
    with pytest.raises(ValidationError, match=field if field != "stop" else "stop"):
        SamplingParams(**{field: value})


def test_stop_strings_wait_for_min_tokens(tok_dir):
    """A stop string ends the output only where it ends past the text of the first min_tokens
    tokens, as vLLM's; the text stops before it. A request resumed after such a held-back stop
    string (its earlier output in the prompt, nothing left of min_tokens) does not stop on it."""
    from workers.models.loader import load_tokenizer

    tokenizer = load_tokenizer(tok_dir)
    stream = tokenizer.encode("one. two. three. four.")
    texts = {}
    two = len(tokenizer.encode("one. two"))
    for min_tokens, resumed in ((0, 0), (1, 0), (2, 0), (two + 1, 0), (2, two)):
        s = Scheduler(1, 512, 512, 3, {tokenizer.eos_token_id}, tokenizer)
        params = SamplingParams(
            max_tokens=len(stream) - resumed,
            stop=["."],
            min_tokens=max(0, min_tokens - resumed),
            prior_output_tokens=resumed,
        )
        r = s.add("r", [1, 2, 3] + stream[:resumed], params)
        fed = resumed
        while not r.is_finished:
            plan = s.plan()
            n = 1 if plan.prefills else min(3, len(stream) - fed)
            tokens = torch.zeros(1, 4, dtype=torch.long)
            tokens[0, :n] = torch.tensor(stream[fed : fed + n])
            s.process(plan, StepResult(plan.step_id, tokens.numpy(), torch.tensor([n]).numpy()))
            fed += n
        assert r.finish_reason == "stop"
        texts[min_tokens, resumed] = r.text
    assert list(texts.values()) == ["one", "one", "one. two", "one. two. three", "one. two"]


def test_engine_seed_is_bounded():
    """Requests without a seed get engine seed * 1000003 + n, which must fit int64 on the device."""
    EngineConfig(model="m", seed=2**40)
    with pytest.raises(ValidationError, match="seed"):
        EngineConfig(model="m", seed=10**13)


def test_abort_ends_waiting_and_running_requests():
    """An aborted request ends with finish_reason "abort" whether it was waiting or running, and a
    running one's slot comes back once its step in flight is processed."""
    s = Scheduler(1, 64, 64, 0, {0}, None)
    running, waiting = (
        s.add("a", [1, 2], SamplingParams(max_tokens=8)),
        s.add("b", [3], SamplingParams(max_tokens=8)),
    )
    plan = s.plan()
    s.abort("b")
    s.abort("a")
    assert running.finish_reason == waiting.finish_reason == "abort" and s.num_waiting == 0
    s.process(plan, StepResult(plan.step_id, np.array([[5]]), np.array([1])))
    assert not s.has_work and s.free_slots == [0] and running.output_ids == []


# ---- the extra pass and the overlapped loop ----


def collect(engine, prompts, params, joins):
    """run_to_completion, keeping every RequestOutput streamed, per request."""
    streamed = {}
    requests = run_to_completion(
        engine, prompts, params, joins, lambda i, out: streamed.setdefault(i, []).append(out)
    )
    return requests, streamed


def mixed_workload():
    prompts = tiny_prompts(8, seed=40)
    params = [
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=16, temperature=1.0, seed=3),
        SamplingParams(max_tokens=5),
        SamplingParams(max_tokens=24, temperature=0.8, seed=9),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=24, temperature=0.7, top_k=5, seed=1),
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=11, temperature=1.0, seed=5),
    ]
    return prompts, params, [0, 0, 0, 1, 2, 2, 6, 9]


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory, tiny_dir):
    """The tiny target with a frequent greedy token as EOS, so many requests stop early."""
    outs = solo_outputs(
        tiny_engine(tiny_dir),
        tiny_prompts(8, seed=40),
        SamplingParams(max_tokens=24, ignore_eos=True),
    )
    counts = torch.bincount(torch.tensor([t for o in outs for t in o[2:]]), minlength=64)
    return write_tiny_llama(tmp_path_factory.mktemp("eos") / "m", eos_token_id=int(counts.argmax()))


@pytest.mark.parametrize("drafter", ["none", "drafter"])
def test_overlap_equals_no_overlap_and_extra_pass_is_silent(eos_dir, tiny_drafter_dir, drafter):
    drafter = tiny_drafter_dir if drafter == "drafter" else "none"
    prompts, params, joins = mixed_workload()
    runs = {}
    for overlap in (False, True):
        engine = tiny_engine(eos_dir, drafter, k=3, max_batch_size=4, overlap=overlap)
        requests, streamed = collect(engine, prompts, params, joins)
        runs[overlap] = [(r.output_ids, r.finish_reason) for r in requests]
        for i, r in enumerate(requests):
            outs = streamed[i]
            assert [t for o in outs for t in o.new_token_ids] == r.output_ids
            assert outs[-1].finish_reason == r.finish_reason and all(
                o.finish_reason is None for o in outs[:-1]
            )
        if overlap:
            # the extra pass happened ... and was dropped
            assert engine.scheduler.stats.num_extra_rows > 0
    assert runs[True] == runs[False]
    assert {reason for _, reason in runs[True]} == {"stop", "length"}
