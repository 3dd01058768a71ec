"""Checked with what nobody here wrote: response bodies against OpenAI's published OpenAPI document
(tests/openai_schema), loglikelihoods as lm-evaluation-harness reads them against transformers,
and every bounded request field at its bound and one past it; and vLLM's priority scheduling, the
server's policy here. A tiny random model (SmolLM2's tokenizer) whose EOS greedy decoding reaches,
with a drafter; fp32 on CPU."""

import concurrent.futures
import json
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import write_random_drafter
from ray import serve
from serve_app import start_app, stop_app
from tiny_models import tiny_llama

from deployments.config import ServeConfig
from deployments.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "tiny"
# (context, continuation): lm-eval's loglikelihood requests; the first one's next greedy token is
# made the model's EOS
PAIRS = [
    ("The capital of France is", " Paris"),
    ("Two plus two equals", " four"),
    ("The sky is", " blue today"),
]
CHAT = [{"role": "user", "content": "Say hello."}]
CHAT_EOS = [{"role": "user", "content": "Name a fruit."}]  # its next greedy token is made an EOS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from speculative.engine.llm_engine import encode_prompt
    from workers.models.loader import load_tokenizer

    path = tiny_llama(tmp_path_factory.mktemp("conf") / "tiny", layers=4, max_positions=256)
    config = json.loads((path / "config.json").read_text()) | {"model_type": "llama"}
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(path)
    eos = [2]
    for ids in (tokenizer.encode("".join(PAIRS[0])), encode_prompt(tokenizer, CHAT_EOS)):
        with torch.no_grad():
            eos.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": eos}))
    return path


@pytest.fixture(scope="module")
def base_url(model_dir):
    cfg = ServeConfig(
        engine={
            "model": str(model_dir),
            "drafter": str(write_random_drafter(model_dir.parent / "drafter", model_dir)),
            "num_draft_tokens": 3,
            "max_batch_size": 8,
            "max_model_len": 256,
            # a step's budget under the context: long prompts prefill in chunks
            "max_num_batched_tokens": 128,
            "device": "cpu",
            "dtype": "float32",
            "scheduling_policy": "priority",  # priority's bounds, and its order (below)
        },
        served_model_name=MODEL,
        max_waiting_requests=130,  # n at its bound, 128, fits a replica
    )
    url = start_app(cfg, num_cpus=2)
    yield url
    stop_app()


def post(base_url, path, body) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": MODEL} | body, timeout=300)


def ok(base_url, path, body) -> dict:
    r = post(base_url, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def events(base_url, path, body) -> list[dict]:
    r = post(base_url, path, body | {"stream": True})
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- OpenAI's published schema ----


def _nullable(node):
    """OpenAPI 3.0's `nullable: true`, which the 3.1 document still uses in places, as JSON
    Schema's null type (jsonschema does not know the keyword)."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


SPEC = json.loads((Path(__file__).parent / "openai_schema" / "components.json").read_text())
COMPONENTS = _nullable(SPEC["components"])


def check(body: dict, schema: str, patch=None) -> None:
    components = json.loads(json.dumps(COMPONENTS))
    if patch:
        patch(components["schemas"])
    root = {"$ref": f"#/components/schemas/{schema}", "components": components}
    jsonschema.Draft202012Validator(root).validate(body)


def _legacy_completions(schemas) -> None:
    """What OpenAI's legacy completions send and the document leaves out: an echoed prompt's first
    token has no log-probability (null, as lm-eval expects), and a stream chunk's finish_reason is
    null until the last, its usage null but in the last (with include_usage, as in chat chunks)."""
    choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]
    logprobs = choice["properties"]["logprobs"]["anyOf"][0]["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        logprobs[name]["items"] = {"anyOf": [logprobs[name]["items"], {"type": "null"}]}
    reason = choice["properties"]["finish_reason"]
    choice["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    usage = schemas["CreateCompletionResponse"]["properties"]["usage"]
    schemas["CreateCompletionResponse"]["properties"]["usage"] = {
        "anyOf": [usage, {"type": "null"}]
    }


def test_the_schema_components_name_their_source():
    assert SPEC["source"].startswith("https://github.com/openai/openai-openapi/blob/")
    assert SPEC["version"] and "CreateChatCompletionResponse" in SPEC["components"]["schemas"]


CHAT_BODIES = {
    "plain": {"messages": CHAT, "max_tokens": 8},
    "logprobs": {"messages": CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": 3},
    "n=2 sampled": {"messages": CHAT, "max_tokens": 6, "n": 2, "temperature": 1, "seed": 3},
    "stop": {"messages": CHAT, "max_tokens": 8, "stop": ["a", "e"], "temperature": 0},
}
COMPLETION_BODIES = {
    "string": {"prompt": "Once upon a time", "max_tokens": 8},
    "echo logprobs": {"prompt": "Once upon a time", "max_tokens": 4, "echo": True, "logprobs": 2},
    "prompts": {"prompt": [[504, 3575], [10345]], "max_tokens": 3, "n": 2},
    "strings": {"prompt": ["Hello", "The sky"], "max_tokens": 3},
    "score only": {"prompt": "The sky is blue", "max_tokens": 0, "echo": True, "logprobs": 1},
}


@pytest.mark.parametrize("name", list(CHAT_BODIES))
def test_chat_conforms(base_url, name):
    body = CHAT_BODIES[name]
    reply = ok(base_url, "/v1/chat/completions", body)
    check(reply, "CreateChatCompletionResponse")
    assert len(reply["choices"]) == body.get("n", 1)
    chunks = events(
        base_url, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}
    )
    for chunk in chunks:
        check(chunk, "CreateChatCompletionStreamResponse")
    assert chunks[-1]["usage"] == reply["usage"] or body.get("temperature", 1) != 0


@pytest.mark.parametrize("name", list(COMPLETION_BODIES))
def test_completions_conform(base_url, name):
    body = COMPLETION_BODIES[name]
    reply = ok(base_url, "/v1/completions", body)
    check(reply, "CreateCompletionResponse", _legacy_completions)
    for chunk in events(
        base_url, "/v1/completions", body | {"stream_options": {"include_usage": True}}
    ):
        check(chunk, "CreateCompletionResponse", _legacy_completions)


def test_models_and_errors_conform(base_url):
    models = httpx.get(f"{base_url}/v1/models").json()
    check(models, "ListModelsResponse")
    check(httpx.get(f"{base_url}/v1/models/{MODEL}").json(), "Model")
    for path, body, status in [
        ("/v1/completions", {"prompt": "x", "temperature": 3}, 400),
        ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
        ("/v1/nowhere", {}, 404),
    ]:
        r = post(base_url, path, body)
        assert r.status_code == status, r.text
        check(r.json(), "ErrorResponse")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_eos_is_a_generated_token(base_url, path, stream):
    """A reply whose first token is the EOS: that token, with no text, its log-probability in
    the logprobs and counted in usage (as vLLM does), streamed or not, through the drafter."""
    if "chat" in path:
        body = {"messages": CHAT_EOS, "logprobs": True, "top_logprobs": 1}
    else:
        body = {"prompt": "".join(PAIRS[0]), "logprobs": 1}
    body |= {"max_tokens": 5, "temperature": 0}
    if stream:
        chunks = events(base_url, path, body | {"stream_options": {"include_usage": True}})
        choices = [c for chunk in chunks for c in chunk["choices"]]
        usage = chunks[-1]["usage"]
    else:
        reply = ok(base_url, path, body)
        choices, usage = reply["choices"], reply["usage"]
    assert usage["completion_tokens"] == 1 and choices[-1]["finish_reason"] == "stop"
    if "chat" in path:
        text = "".join(
            c["delta"].get("content", "") if stream else c["message"]["content"] for c in choices
        )
        logprobs = [
            e["logprob"] for c in choices if c["logprobs"] for e in c["logprobs"]["content"]
        ]
    else:
        text = "".join(c["text"] for c in choices)
        logprobs = [lp for c in choices if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert text == "" and len(logprobs) == 1 and logprobs[0] < 0


# ---- what clients send ----


def test_every_prompt_form(base_url, model_dir):
    """A string, strings, token ids and lists of them: each prompt its own n choices, indexed
    i * n + j as OpenAI does, each as if it came alone."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    alone = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in ("Hello", "The sky is")
    }
    ids = ok(base_url, "/tokenize", {"prompt": "The sky is"})["tokens"]
    for prompt in (
        ["Hello", "The sky is"],
        [ok(base_url, "/tokenize", {"prompt": "Hello"})["tokens"], ids],
    ):
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0, n=2
        )
        texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
        assert texts == [alone["Hello"]] * 2 + [alone["The sky is"]] * 2
        assert reply.usage.prompt_tokens == sum(
            len(ok(base_url, "/tokenize", {"prompt": p})["tokens"]) for p in ("Hello", "The sky is")
        )
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert single.choices[0].text == alone["The sky is"]
    streamed = events(
        base_url, "/v1/completions", {"prompt": [ids, ids], "max_tokens": 5, "temperature": 0}
    )
    text = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk["choices"]:
            text[c["index"]] += c["text"]
    assert text == {0: alone["The sky is"], 1: alone["The sky is"]}


def test_spec_values_accepted(base_url):
    """Values OpenAI's schema allows that ask for nothing we lack: top_p 0 (greedy), an int64
    seed below 0, max_tokens 0 with echo (the prompt scored only), the no-op values of options we
    do not implement. A value that would change behaviour stays a 400 naming the field."""
    greedy = ok(
        base_url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    )
    sampled = {"messages": CHAT, "max_tokens": 8, "temperature": 1.5}
    top_p0 = ok(base_url, "/v1/chat/completions", sampled | {"top_p": 0})
    assert top_p0["choices"][0]["message"] == greedy["choices"][0]["message"]
    seeded = [ok(base_url, "/v1/chat/completions", sampled | {"seed": -(2**63)}) for _ in range(2)]
    assert seeded[0]["choices"] == seeded[1]["choices"]
    scored = ok(
        base_url,
        "/v1/completions",
        {"prompt": "The sky is blue", "max_tokens": 0, "echo": True, "logprobs": 1},
    )
    choice = scored["choices"][0]
    assert choice["text"] == "The sky is blue" and scored["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == scored["usage"]["prompt_tokens"]
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["finish_reason"] == "length"
    no_ops = {"service_tier": "auto", "modalities": ["text"], "store": False, "metadata": {}}
    assert (
        ok(base_url, "/v1/chat/completions", greedy_body() | no_ops)["choices"] == greedy["choices"]
    )
    plain = ok(base_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    legacy = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "best_of": 1, "suffix": ""}
    assert ok(base_url, "/v1/completions", legacy)["choices"] == plain["choices"]
    for path, name, value in [
        ("/v1/chat/completions", "service_tier", "flex"),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/completions", "best_of", 2),
        ("/v1/completions", "suffix", " end"),
        ("/v1/chat/completions", "store", True),
    ]:
        base = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
        r = post(base_url, path, base | {"max_tokens": 2, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)


def greedy_body() -> dict:
    return {"messages": CHAT, "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": [[1, 2], "x"]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2.5]]}, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [CHAT[0], {"role": "user", "content": 5}]},
            "messages[1].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
        ),
        ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop"),
    ],
)
def test_errors_name_the_request_field(base_url, path, body, param):
    r = post(base_url, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, r.text
    assert error["message"].startswith(f"{param}: ")
    assert ".str" not in error["message"] and "list[" not in error["message"]


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [CHAT[0], CHAT[0] | {"foo": 1}]}, "messages[1].foo"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "b": 1}]}]},
            "messages[0].content[0].b",
        ),
        ({"messages": [CHAT[0] | {"tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "system", "content": "x", "tool_calls": [CALL]}, *CHAT]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [*CHAT, {"role": "assistant", "tool_calls": [CALL | {"index": 0}]}]},
            "messages[1].tool_calls[0].index",
        ),
        (
            {"messages": [*CHAT, {"role": "tool", "content": "x", "tool_call_id": "c1", "x": 0}]},
            "messages[1].x",
        ),
        ({"tools": [TOOL | {"cache": True}]}, "tools[0].cache"),
        (
            {"tools": [{"type": "function", "function": TOOL["function"] | {"examples": []}}]},
            "tools[0].function.examples",
        ),
        (
            {
                "tools": [TOOL],
                "tool_choice": {
                    "type": "function",
                    "function": {"name": "get_weather", "strict": True},
                },
            },
            "tool_choice.function.strict",
        ),
        (
            {"stream": True, "stream_options": {"include_usage": True, "usage": True}},
            "stream_options.usage",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "format": 1}}},
            "response_format.json_schema.format",
        ),
        ({"structured_outputs": {"regex": "a+", "flags": "i"}}, "structured_outputs.flags"),
    ],
)
def test_unknown_nested_keys_get_400_naming_them(base_url, body, param):
    """A key that an object inside the request does not define is refused as the top level refuses
    one: an unsupported parameter, named with where it is."""
    r = post(base_url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2} | body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, r.text
    assert error["message"] == f"unsupported parameter {param!r}"
    assert error["code"] == "unsupported_parameter"
    check(r.json(), "ErrorResponse")


def test_the_official_clients_requests_pass_the_nested_checks(base_url):
    """What the openai client sends: tools (also from a pydantic model, strict), tool_choice,
    stream_options, response_format from a pydantic model, and an earlier reply's message object
    sent back with the tool's answer."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        city: str

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    tools = [TOOL, openai.pydantic_function_tool(Answer)]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=4,
            tools=tools,
            tool_choice="auto",
            parallel_tool_calls=False,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens > 0
    try:  # the random model's JSON may not end within max_tokens: the client raises then
        parsed = client.chat.completions.parse(
            model=MODEL, messages=CHAT, max_tokens=4, response_format=Answer
        )
    except openai.LengthFinishReasonError as e:
        parsed = e.completion
    # a call without arguments: the grammar lets the random model end it in a few tokens
    now = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    now["function"]["parameters"] |= {"properties": {}, "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=40,
        tools=[*tools, now],
        tool_choice={"type": "function", "function": {"name": "now"}},
        parallel_tool_calls=False,
    )
    message = reply.choices[0].message  # sent back as the client serialises it
    [call] = message.tool_calls
    history = [*CHAT, message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    history += [parsed.choices[0].message]
    again = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=4, tools=[*tools, now]
    )
    assert again.usage.prompt_tokens > reply.usage.prompt_tokens


# ---- every bounded field: at its bound it goes through, one past it is a 400 ----


def _bounds(model) -> list[tuple[str, str, object]]:
    keys = ("ge", "gt", "le", "lt", "max_length", "min_length")
    return [
        (name, key, getattr(m, key))
        for name, field in model.model_fields.items()
        for m in field.metadata
        for key in keys
        if getattr(m, key, None) is not None
    ]


def _at_and_past(name: str, key: str, bound):
    """(the field's value at its bound, one past it)."""
    step = 1 if isinstance(bound, int) else 0.01
    if key in ("max_length", "min_length"):
        sizes = (bound, bound + 1) if key == "max_length" else (bound, bound - 1)
        build = {
            "stop_token_ids": lambda k: [5] * k,
            "logit_bias": lambda k: {str(i): 1.0 for i in range(k)},
            "messages": lambda k: CHAT * k,
        }[name]
        return tuple(build(k) for k in sizes)
    return {
        "ge": (bound, bound - step),
        "gt": (bound + step, bound),
        "le": (bound, bound + step),
        "lt": (bound - step, bound),
    }[key]


BOUNDED = [
    (path, name, key, bound)
    for path, model in (
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/v1/completions", CompletionRequest),
    )
    for name, key, bound in _bounds(model)
]


@pytest.mark.parametrize(
    "path,name,key,bound", BOUNDED, ids=[f"{p.split('/')[-1]}-{n}-{k}" for p, n, k, _ in BOUNDED]
)
def test_bounded_field_at_and_past_its_bound(base_url, path, name, key, bound):
    """The request models' bounds (taken from SamplingParams where it has the field, so the two
    cannot drift): a value the request accepts is served, not a 500."""
    base = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
    base |= {"max_tokens": 1}
    if name == "top_logprobs":
        base["logprobs"] = True
    if name == "max_tokens" and "chat" not in path:
        base["echo"] = True
    at, past = _at_and_past(name, key, bound)
    r = post(base_url, path, base | {name: at})
    assert r.status_code == 200, r.text
    r = post(base_url, path, base | {name: past})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


# ---- lm-evaluation-harness's loglikelihood, as its local-completions model computes it ----


def _reference(model_dir, ids: list[int], ctxlen: int) -> tuple[float, bool]:
    """transformers' (fp32) log-likelihood of ids[ctxlen:] after ids[:ctxlen], and whether each
    of those tokens is the greedy one."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    rows = logprobs[ctxlen - 1 : len(ids) - 1]
    cont = torch.tensor(ids[ctxlen:])
    total = float(rows.gather(1, cont[:, None]).sum())
    return total, bool((rows.argmax(-1) == cont).all())


def _lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs, for one choice."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))
    return sum(token_logprobs), is_greedy


def test_lm_eval_loglikelihoods_equal_transformers(base_url, model_dir):
    """lm-eval's request (echo, logprobs 1, max_tokens 1, temperature 0; a batch of token-id
    lists, or strings) sliced as lm-eval slices it, token_logprobs[ctxlen:-1], equals transformers
    within 1e-4, where the next greedy token is the EOS (which must be the one generated token)
    and where it is not."""
    tokenize = lambda text: ok(base_url, "/tokenize", {"prompt": text})["tokens"]  # noqa: E731
    cases = [(tokenize(c), tokenize(x)) for c, x in PAIRS]
    assert all(tokenize(c + x) == ci + xi for (c, x), (ci, xi) in zip(PAIRS, cases))
    request = {"max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234}
    by_ids = ok(base_url, "/v1/completions", request | {"prompt": [c + x for c, x in cases]})
    by_text = [ok(base_url, "/v1/completions", request | {"prompt": c + x}) for c, x in PAIRS]
    choices = sorted(by_ids["choices"], key=lambda c: c["index"])
    assert [c["finish_reason"] for c in choices][0] == "stop"  # the EOS, the one generated token
    assert {c["finish_reason"] for c in choices[1:]} == {"length"}
    for (ctx, cont), choice, text_reply in zip(cases, choices, by_text):
        want_total, want_greedy = _reference(model_dir, ctx + cont, len(ctx))
        assert len(choice["logprobs"]["tokens"]) == len(ctx) + len(cont) + 1
        for got in (choice, text_reply["choices"][0]):
            total, greedy = _lm_eval_parse(got, len(ctx))
            assert total == pytest.approx(want_total, abs=1e-4) and greedy == want_greedy


# ---- past one step's token budget (128 here, max_model_len 256) ----


def test_penalties_and_prompt_logprobs_past_the_step_budget(base_url, model_dir):
    """A chat with frequency_penalty 0.5 and no max_tokens (so prompt + max_tokens is the whole
    context, twice the budget) is answered, not refused; a 200-token prompt's echoed
    log-probabilities, prefilled in chunks after an earlier request cached its prefix, are every
    position's and equal transformers'; prompt + max_tokens past max_model_len is still a 400."""
    from transformers import AutoModelForCausalLM

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, frequency_penalty=0.5)
    usage = reply.usage
    assert reply.choices[0].finish_reason in ("stop", "length") and usage.completion_tokens >= 1
    assert usage.prompt_tokens + usage.completion_tokens <= 256
    ids = ok(base_url, "/tokenize", {"prompt": "The sky is blue and the grass is green. " * 20})
    ids = ids["tokens"][:200]
    ok(base_url, "/v1/completions", {"prompt": ids, "max_tokens": 2})  # caches its blocks
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    scored = ok(base_url, "/v1/completions", body | {"presence_penalty": 0.5})
    got = scored["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert got[0] is None and len(got) == 200
    torch.testing.assert_close(torch.tensor(got[1:]), want, rtol=1e-4, atol=1e-4)
    r = post(base_url, "/v1/completions", {"prompt": ids, "max_tokens": 57, "frequency_penalty": 1})
    assert r.status_code == 400 and "exceeds" in r.json()["error"]["message"], r.text


# ---- the priority policy: a later, more urgent request goes before a waiting one ----


def _wait_for(condition, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_priority_orders_the_waiting_requests(base_url):
    """Eight long streams take the eight slots; a request of priority 5, then one of -5, wait.
    One stream closed frees one slot: the urgent one, which came later, takes it (it streams
    while one request still waits, the other never streamed); both answer what they answer
    alone (greedy, speculating)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    handle = serve.get_deployment_handle("LLMServer", app_name="eagleserve")
    load = lambda: handle.stats.remote().result(timeout_s=30)  # noqa: E731
    ask = dict(model=MODEL, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})

    def answer(prompt: str, priority: int = 0, **kw):
        body = ask["extra_body"] | {"priority": priority}
        return client.completions.create(prompt=prompt, **ask | {"extra_body": body}, **kw)

    alone = {p: answer(p).choices[0].text for p in ("The sky is", "Two plus two")}
    long = dict(model=MODEL, prompt="Hi", max_tokens=240, stream=True)
    fillers = [client.completions.create(**long, extra_body={"ignore_eos": True}) for _ in range(8)]
    try:
        _wait_for(lambda: load()["num_running"] == 8)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            low = pool.submit(answer, "The sky is", 5)
            _wait_for(lambda: load()["num_waiting"] == 1)
            urgent = iter(answer("Two plus two", -5, stream=True))
            _wait_for(lambda: load()["num_waiting"] == 2)
            fillers.pop().close()
            first = next(urgent)
            assert load()["num_waiting"] == 1 and not low.done()
            text = "".join(c.choices[0].text for c in [first, *urgent] if c.choices)
            assert text == alone["Two plus two"]
            fillers.pop().close()
            assert low.result().choices[0].text == alone["The sky is"]
    finally:
        for stream in fillers:
            stream.close()
