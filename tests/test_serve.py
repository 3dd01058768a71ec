"""The Ray Serve OpenAI endpoint, tested over real HTTP with the official openai client."""

import concurrent.futures
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prom_text import label_sets, promql_metric_names, scrape, scrape_until, total
from ray import serve
from serve_app import start_app, stop_app

from deployments.config import ServeConfig

MODEL = "smollm2-135m"
GRAFANA = "deploy/grafana/eagleserve.json"
KEY = "test-key"
QUESTIONS = [
    "What is 2+2?",
    "Name a fruit.",
    "Say hello.",
    "What color is the sky?",
    "Count to five.",
    "Name a planet.",
    "What is the capital of Italy?",
    "Give me a synonym for happy.",
]


@pytest.fixture(scope="module")
def base_url():
    cfg = ServeConfig(
        engine={"max_batch_size": 16, "max_model_len": 512}, api_key=KEY, max_waiting_requests=8
    )
    url = start_app(cfg, num_cpus=4)
    yield url
    stop_app()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, question, max_tokens=24, temperature=0, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=temperature,
        **kw,
    )


@pytest.fixture(scope="module")
def alone(client):
    """Greedy answers, each run with no other request in flight."""
    return {q: chat(client, q).choices[0].message.content for q in QUESTIONS}


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_chat_non_streaming(client, alone):
    r = chat(client, QUESTIONS[0])
    assert r.choices[0].message.content == alone[QUESTIONS[0]] and r.choices[0].message.content
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_streaming_equals_non_streaming(client, alone):
    stream = chat(client, QUESTIONS[1], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == alone[QUESTIONS[1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_sse_wire_format_ends_with_done(base_url):
    body = {
        "model": MODEL,
        "prompt": "The sky is",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["object"] == "text_completion"
    # with include_usage, every chunk has "usage": null but the last: the counts and no choices
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []


def test_completions(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    s = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert r.choices[0].text == "".join(c.choices[0].text for c in s if c.choices) != ""
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_n_choices_are_seeded_requests(client, alone):
    """Choice i of a seeded request is the request with seed + i (as vLLM's), the same again when
    asked again; streamed, the choices interleave by index and equal the non-streamed ones; greedy,
    n equal choices are the n=1 answer. Usage counts every choice's tokens. (top_k keeps the draws
    off the float32 noise of the distribution's tail, which changes with the batch's shape.)"""
    kw = dict(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=1.0,
        extra_body={"top_k": 5},
        seed=7,
    )
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    single = [client.completions.create(**{**kw, "seed": 7 + i}) for i in range(3)]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in single]
    assert len({c.text for c in r.choices}) > 1  # sampled apart
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == [
        c.text for c in r.choices
    ]
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in single)
    assert r.usage.prompt_tokens == single[0].usage.prompt_tokens

    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=10,
        temperature=1.0,
        extra_body={"top_k": 5},
        seed=3,
        n=2,
    )
    stream = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    full = client.chat.completions.create(**kw)
    for i, choice in enumerate(full.choices):
        deltas = [c.choices[0] for c in stream if c.choices and c.choices[0].index == i]
        assert (
            deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == choice.finish_reason
        )
        assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
    assert stream[-1].usage.completion_tokens == full.usage.completion_tokens
    greedy, one = chat(client, QUESTIONS[3], n=3), chat(client, QUESTIONS[3])
    assert [c.message.content for c in greedy.choices] == [alone[QUESTIONS[3]]] * 3
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens


def test_logprobs(client, alone):
    """Per token: its text, log-probability and top alternatives (greedy: the token is the top one),
    the same streamed; completions' legacy form with text offsets."""
    r = chat(client, QUESTIONS[4], logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == alone[QUESTIONS[4]]
    assert (
        len(content) == r.usage.completion_tokens
        and "".join(e.token for e in content) == alone[QUESTIONS[4]]
    )
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token and e.logprob <= 0
        assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob
        assert bytes(e.bytes).decode() == e.token
    streamed = [
        e
        for c in chat(client, QUESTIONS[4], logprobs=True, top_logprobs=2, stream=True)
        for e in (c.choices[0].logprobs.content if c.choices and c.choices[0].logprobs else [])
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert chat(client, QUESTIONS[4]).choices[0].logprobs is None

    c = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=3
    ).choices[0]
    lp = c.logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        and "".join(lp.tokens) == c.text
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(6)]
    assert all(
        len(top) == 3 and max(top.values()) == pytest.approx(v)
        for top, v in zip(lp.top_logprobs, lp.token_logprobs)
    )


def test_logprob_tokens_keep_their_bytes():
    """Tokens holding part of a UTF-8 character: their bytes rebuild the text, their strings are
    vLLM's bytes:\\xNN form, and text offsets point into the text; special tokens take no room."""
    from deployments.logprobs import LogprobFormatter, TextOffsets
    from workers.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(MODEL))
    text = " 明白 🎉\nhéllo"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    f = LogprobFormatter(tokenizer)
    entries = [(t, (-1.0, [(t, -1.0)])) for t in ids]
    content = f.chat(entries)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content[:-1]).decode() == text
    assert any(e["token"].startswith("bytes:\\x") for e in content)  # a split character
    body = f.completion(entries, TextOffsets())
    data = [bytes(e["bytes"]) for e in content]
    # a token starts after the whole characters of the tokens before it; EOS, after the text
    assert body["text_offset"] == [
        len(b"".join(data[:i]).decode(errors="ignore")) for i in range(len(ids))
    ]
    assert body["text_offset"][-1] == len(text) and body["tokens"] == [e["token"] for e in content]
    # every token the text leaves out takes no room (<file_sep> is special, though not in
    # all_special_ids);
    # in an echoed prompt, given as text, each takes its own
    ids = tokenizer.encode("<file_sep>def f(): return 1", add_special_tokens=False)
    shown = tokenizer.decode(ids, skip_special_tokens=True)
    offsets = f.completion([(t, (-1.0, [])) for t in ids], TextOffsets())["text_offset"]
    assert [shown[a:b] for a, b in zip(offsets, offsets[1:] + [len(shown)])] == [
        tokenizer.decode([t], skip_special_tokens=True) for t in ids
    ]
    offsets = f.completion([(t, (-1.0, [])) for t in ids], TextOffsets(verbatim=len(ids)))[
        "text_offset"
    ]
    assert offsets[1] == len("<file_sep>")


def test_echo_returns_the_prompt_and_its_logprobs(client):
    """echo (as lm-eval's loglikelihood requests use it): the prompt before the completion, its
    tokens' log-probabilities (the first has none) before the completion's, streamed alike."""
    prompt, kw = (
        "The capital of France is",
        dict(model=MODEL, max_tokens=3, temperature=0, logprobs=2),
    )
    plain = client.completions.create(prompt=prompt, **kw)
    r = client.completions.create(prompt=prompt, echo=True, **kw)
    c, n = r.choices[0], r.usage.prompt_tokens
    assert c.text == prompt + plain.choices[0].text
    lp = c.logprobs
    assert len(lp.tokens) == n + 3 and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(
        v <= 0 and len(top) == 2 for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:])
    )
    assert lp.token_logprobs[n:] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-4
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(n + 3)]
    chunks = [
        ch.choices[0]
        for ch in client.completions.create(prompt=prompt, echo=True, stream=True, **kw)
        if ch.choices
    ]
    assert "".join(ch.text for ch in chunks) == c.text
    assert [t for ch in chunks if ch.logprobs for t in ch.logprobs.tokens] == lp.tokens
    bare = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True
    )
    assert bare.choices[0].text == c.text and bare.choices[0].logprobs is None


def test_tokenize_detokenize_and_stop_token_ids(base_url, client, alone):
    """vLLM's /tokenize and /detokenize (the ids the completion endpoints encode), and its
    stop_token_ids extension: the answer ends with the first such token, a generated token with
    no text (as in vLLM)."""

    def post(path, body):
        r = _post(base_url, path, json.dumps({"model": MODEL} | body))
        assert r.status_code == 200, r.text
        return r.json()

    question = QUESTIONS[6]
    ids = post("/tokenize", {"messages": [{"role": "user", "content": question}]})
    assert (
        ids["count"]
        == chat(client, question, max_tokens=1).usage.prompt_tokens
        == len(ids["tokens"])
    )
    assert post(
        "/detokenize", {"tokens": post("/tokenize", {"prompt": "Hello there"})["tokens"]}
    ) == {"prompt": "Hello there"}
    first = post("/tokenize", {"prompt": alone[question]})["tokens"][0]  # the answer's first token
    r = chat(client, question, extra_body={"stop_token_ids": [first]})
    assert (
        r.choices[0].finish_reason == "stop"
        and r.choices[0].message.content == ""
        and r.usage.completion_tokens == 1
    )
    assert (
        _post(base_url, "/detokenize", json.dumps({"model": MODEL, "tokens": [10**9]})).status_code
        == 400
    )
    assert _post(base_url, "/tokenize", json.dumps({"model": MODEL})).status_code == 400


def test_sampling_options_reach_the_engine(client, base_url, alone):
    """A frequency or repetition penalty changes a greedy answer that repeats tokens, a logit_bias
    of -100 on its first token changes how it begins, and min_p 1 makes sampling greedy (exactness:
    test_lossless)."""
    question = "Count to five."
    penalised = (
        chat(client, question, max_tokens=24, frequency_penalty=2.0).choices[0].message.content
    )
    assert penalised and penalised != alone[question]
    repeats = (
        chat(client, question, max_tokens=24, extra_body={"repetition_penalty": 3.0})
        .choices[0]
        .message.content
    )
    assert repeats and repeats != alone[question]
    short = chat(client, question, max_tokens=100)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 100
    held = chat(client, question, max_tokens=104, extra_body={"min_tokens": 100})
    assert held.usage.completion_tokens >= 100 and held.choices[0].message.content.startswith(
        alone[question][:20]
    )
    assert (
        chat(client, question, frequency_penalty=0.0).choices[0].message.content == alone[question]
    )
    first = _post(
        base_url, "/tokenize", json.dumps({"model": MODEL, "prompt": alone[question]})
    ).json()["tokens"][0]
    banned = chat(client, question, logit_bias={str(first): -100}).choices[0].message.content
    assert (
        banned
        and _post(base_url, "/tokenize", json.dumps({"model": MODEL, "prompt": banned})).json()[
            "tokens"
        ][0]
        != first
    )
    question = "Give me a synonym for happy."
    sampled = chat(client, question, temperature=1.0, seed=3).choices[0].message.content
    assert sampled != alone[question]  # this seed's draws leave the greedy path
    assert (
        chat(client, question, temperature=1.0, seed=3, extra_body={"min_p": 1.0})
        .choices[0]
        .message.content
        == alone[question]
    )


def _post(base_url, path, content, key=KEY, headers=None):
    h = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {key}"} if key else {}),
        **(headers or {}),
    }
    return httpx.post(f"{base_url}{path}", content=content, headers=h, timeout=180)


BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", "{not json", 400),
    ("wrong type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
    (
        "max_tokens 0",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        400,
    ),
    ("temperature 3", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 3}, 400),
    (
        "unknown model",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        404,
    ),
    (
        "n over OpenAI's 128",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 129},
        400,
    ),
    (
        "n over a replica's slots + queue",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "n": 25},
        400,
    ),
    (
        "presence_penalty over 2",
        "/v1/chat/completions",
        {"model": MODEL, "presence_penalty": 2.5, "messages": [{"role": "user", "content": "x"}]},
        400,
    ),
    ("min_p over 1", "/v1/completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400),
    (
        "repetition_penalty 0",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "repetition_penalty": 0},
        400,
    ),
    (
        "min_tokens over max_tokens",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "min_tokens": 17},
        400,
    ),
    (
        "stop token id outside the vocabulary",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stop_token_ids": [10**6]},
        400,
    ),
    (
        "logit_bias key not a token id",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"x": 1}},
        400,
    ),
    (
        "logit_bias key of 5000 digits",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"9" * 5000: 1}},
        400,
    ),
    (
        "logit_bias value true",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"1": True}},
        400,
    ),
    (
        "logit_bias over 100",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"1": 101}},
        400,
    ),
    (
        "logit_bias outside the vocabulary",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"1000000": 1}},
        400,
    ),
    ("logprobs over 20", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400),
    (
        "logprobs true on completions",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logprobs": True},
        400,
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"model": MODEL, "top_logprobs": 2, "messages": [{"role": "user", "content": "x"}]},
        400,
    ),
    ("unknown option", "/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": "hello " * 600}, 400),
    (
        "max_tokens over context",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 100000},
        400,
    ),
    ("bad token id", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("boolean token ids", "/v1/completions", {"model": MODEL, "prompt": [True, False]}, 400),
    (
        "stream_options without stream",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
        400,
    ),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error(base_url, name, path, body, status):
    r = _post(base_url, path, body if isinstance(body, str) else json.dumps(body))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]


def test_null_options_take_their_defaults(client, base_url, alone):
    """OpenAI's schema lets options be null (some clients send them so); a default-valued
    response_format is accepted too."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTIONS[0]}],
        "max_tokens": 24,
        "temperature": 0,
        "top_p": None,
        "n": None,
        "stream": None,
        "stop": None,
        "seed": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "response_format": {"type": "text"},
    }
    r = _post(base_url, "/v1/chat/completions", json.dumps(body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == alone[QUESTIONS[0]]
    body = {
        "model": MODEL,
        "prompt": "The sky is",
        "temperature": None,
        "max_tokens": None,
    }  # completions: 16
    assert (
        _post(base_url, "/v1/completions", json.dumps(body)).json()["usage"]["completion_tokens"]
        <= 16
    )


def test_bad_input_harms_no_other_request(client, base_url, alone):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = pool.submit(chat, client, QUESTIONS[2])
        bad = [
            pool.submit(_post, base_url, "/v1/completions", json.dumps(b[2]))
            for b in BAD_REQUESTS[:6]
            if b[1] == "/v1/completions" or True
        ]
        assert good.result().choices[0].message.content == alone[QUESTIONS[2]]
        assert all(400 <= f.result().status_code < 500 for f in bad)


def test_api_key_required(base_url):
    r = _post(
        base_url,
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
        key=None,
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert (
        httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code
        == 200
    )


def test_request_id_echoed(base_url):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    r = _post(base_url, "/v1/completions", body, headers={"x-request-id": "my-id-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-123"
    assert _post(base_url, "/v1/completions", body).headers.get("x-request-id")


def test_16_concurrent_requests_equal_their_alone_output(client, alone):
    questions = (QUESTIONS * 2)[:16]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda q: chat(client, q).choices[0].message.content, questions))
    assert answers == [alone[q] for q in questions]


@pytest.fixture(scope="module")
def llm_server(base_url):
    return serve.get_deployment_handle("LLMServer", app_name="eagleserve")


def engine_load(llm_server) -> tuple[int, int, float]:
    """(requests running, requests waiting, the fraction of KV blocks in use), from the replica's
    own stats rather than the /metrics text."""
    stats = llm_server.stats.remote().result(timeout_s=30)
    return stats["num_running"], stats["num_waiting"], stats["scheduler"]["kv_cache_usage_perc"]


def _settles_within(llm_server, seconds: float, requests_at_most: int) -> bool:
    """Whether running + waiting requests fall to requests_at_most (0: no KV block held either)."""
    deadline = time.time() + seconds
    while True:
        running, waiting, usage = engine_load(llm_server)
        if running + waiting <= requests_at_most and (requests_at_most or usage == 0):
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.25)


def test_a_client_gone_leaves_nothing_running(client, base_url, llm_server, alone):
    """Streams closed after a few chunks (n=1, and n=3: every choice), and a non-streamed request
    (n=2) whose client stopped waiting, end their requests within seconds (460 tokens take ~20 s
    here), while one greedy request after another runs beside them and answers what it answers
    alone; then nothing runs or waits and no KV block is held. A cancellation is not mistaken for
    a failed replica to resume on."""
    stop = threading.Event()

    def beside() -> list[tuple[str, str]]:
        answers = []
        while not stop.is_set():
            q = QUESTIONS[len(answers) % len(QUESTIONS)]
            answers.append((q, chat(client, q).choices[0].message.content))
        return answers

    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    plain = {"model": MODEL, "max_tokens": 460}
    long = plain | {"extra_body": {"ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answers = pool.submit(beside)
        try:
            for n in (1, 3):
                stream = client.chat.completions.create(messages=story, n=n, stream=True, **long)
                for i, _ in enumerate(stream):
                    if i == 3 * n:
                        break
                stream.close()
                assert _settles_within(llm_server, 5, requests_at_most=1)
            with pytest.raises(httpx.TimeoutException):
                httpx.post(
                    f"{base_url}/v1/completions",
                    json={"prompt": "Once upon a time", "n": 2, "ignore_eos": True} | plain,
                    headers={"Authorization": f"Bearer {KEY}"},
                    timeout=2,
                )
            assert _settles_within(llm_server, 5, requests_at_most=1)
        finally:
            stop.set()
        answers = answers.result()
    assert answers and answers == [(q, alone[q]) for q, _ in answers]
    assert _settles_within(llm_server, 5, requests_at_most=0)


def test_priority_needs_the_priority_policy(client, alone):
    """This server schedules fcfs (the default): a priority other than 0 is a 400 naming it, as
    vLLM documents the field; priority 0 is served."""
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority") as e:
        chat(client, QUESTIONS[0], extra_body={"priority": 1})
    assert e.value.param == "priority"
    answer = chat(client, QUESTIONS[0], extra_body={"priority": 0}).choices[0].message.content
    assert answer == alone[QUESTIONS[0]]


def test_overload_gets_429_not_a_hang(base_url):
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Tell me a story.",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        statuses = list(
            pool.map(lambda _: _post(base_url, "/v1/completions", body).status_code, range(40))
        )
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) > 0 and statuses.count(200) >= 16


def test_health_and_metrics(base_url):
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    samples = scrape(base_url)
    # refusals count too (the bad-input tests above ran first)
    requests = "eagleserve_http_requests_total"
    assert total(samples, requests, endpoint="completions", status="400") >= 1
    assert total(samples, requests, endpoint="chat", status="200") >= 16
    assert total(samples, "vllm:generation_tokens_total") > 0
    assert total(samples, "vllm:prefix_cache_queries_total") > 0
    assert total(samples, "vllm:spec_decode_num_draft_tokens_total") > 0


def test_auto_draft_length_is_served_and_counted(base_url, client):
    """`"speculative": {"num_draft_tokens": "auto"}`: greedy, the text of the server's own K; its
    steps count in /metrics by the K chosen. Another string is a 400 naming the field."""
    steps = "eagleserve_spec_decode_auto_steps_total"
    before = total(scrape(base_url), steps)
    auto = {"speculative": {"num_draft_tokens": "auto"}}
    reply = chat(client, QUESTIONS[0], max_tokens=16, extra_body=auto)
    fixed = chat(client, QUESTIONS[0], max_tokens=16)
    assert reply.choices[0].message.content == fixed.choices[0].message.content
    after = scrape_until(base_url, lambda samples: total(samples, steps) >= before + 3)
    assert total(after, steps) >= before + 3  # at least a step per 6 of the 16 tokens
    with pytest.raises(openai.BadRequestError, match="num_draft_tokens"):
        chat(client, QUESTIONS[0], extra_body={"speculative": {"num_draft_tokens": "often"}})


def test_metrics_move_with_requests_as_vllm_names_them(base_url, client):
    """vLLM's names and labels (plus the replica); the counters, histograms and speculation
    counters per position move by what the requests did."""
    [replica] = httpx.get(f"{base_url}/health", timeout=30).json()["replicas"]
    before = scrape(base_url)
    replies = [chat(client, q, max_tokens=16) for q in QUESTIONS[:3]]
    after = scrape(base_url)  # the one replica is read fresh

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    engine = {"model_name": MODEL, "engine": "0", "replica": replica}
    for name, labels in after:
        if name.startswith("vllm:"):
            assert engine.items() <= labels, (name, labels)
    assert all(after[key] >= value for key, value in before.items() if key[0].endswith("_total"))
    assert delta("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in replies)
    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    for reason in ("stop", "length"):
        finished = sum(r.choices[0].finish_reason == reason for r in replies)
        assert delta("vllm:request_success_total", finished_reason=reason) == finished
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert delta(f"vllm:{histogram}_count") == 3
        assert delta(f"vllm:{histogram}_bucket", le="+Inf") == 3
    assert delta("vllm:inter_token_latency_seconds_count") > 0
    drafts, accepted = "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens"
    positions = sorted(int(ls["position"]) for ls in label_sets(after, f"{accepted}_per_pos_total"))
    assert positions == list(range(5))  # K, the default
    per_pos = [total(after, f"{accepted}_per_pos_total", position=str(j)) for j in positions]
    assert delta(drafts) > 0 and sum(per_pos) == total(after, f"{accepted}_total") > 0
    assert per_pos == sorted(per_pos, reverse=True)  # a position is accepted after the earlier


def test_the_dashboard_reads_only_exported_series(base_url):
    """Every metric the Grafana dashboard queries (its panels and its variables) is exported."""
    dashboard = json.loads((Path(__file__).parents[1] / GRAFANA).read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(<series>, <label>)
            exprs.append(variable["query"]["query"].split("(", 1)[1].rsplit(",", 1)[0])
    wanted = set().union(*map(promql_metric_names, exprs))
    assert {"vllm:spec_decode_num_accepted_tokens_per_pos_total", "eagleserve_replicas"} <= wanted
    exported = {name for name, _ in scrape(base_url)}
    assert wanted <= exported, wanted - exported


def test_serve_config_file_is_valid():
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).parents[1] / "deployments" / "serve_config.yaml"
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app = schema.applications[0]
    assert app.import_path == "deployments.server:build_app"
    ServeConfig.model_validate(app.args)
