"""Tools, tool-call histories, chat template controls, stop options, streamed usage, per-request
speculation and replica-wide /metrics and /health, over real HTTP with the official openai client
against the real server (SmolLM2 with its default drafter, K=5)."""

import json

import httpx
import jsonschema
import openai
import pytest
from prom_text import scrape, total
from serve_app import start_app, stop_app

from deployments.config import ServeConfig

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# greedy SmolLM2 answers this with a call in the plain-JSON format the tool prompt asks for, and
# then goes on: the stop string ends the reply at the call's end
CALL_ME = [{"role": "user", "content": "Call get_weather for Paris."}]
CALL = {"stop": ["\n"], "max_tokens": 96}


@pytest.fixture(scope="module")
def base_url():
    cfg = ServeConfig(engine={"max_batch_size": 8, "max_model_len": 1024}, reasoning_parser="think")
    url = start_app(cfg, num_cpus=4)
    yield url
    stop_app()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, messages, **kw):
    kw = {"max_tokens": 48, "temperature": 0} | kw
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def test_auto_tool_call_whole_and_streamed(client):
    whole = chat(client, CALL_ME, tools=[WEATHER], **CALL)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)

    chunks = list(chat(client, CALL_ME, tools=[WEATHER], **CALL, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    head, *fragments = [d[0] for d in deltas]
    # OpenAI's order: the id, type and name first, then the arguments in fragments
    assert head.id.startswith("call_") and head.type == "function" and head.index == 0
    assert head.function.name == "get_weather" and not head.function.arguments
    assert fragments and all(f.id is None and f.function.name is None for f in fragments)
    assert "".join(f.function.arguments for f in fragments) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_tool_choice_none_leaves_the_reply_as_content(client):
    whole = chat(client, CALL_ME, tools=[WEATHER], **CALL, tool_choice="none")
    message = whole.choices[0].message
    assert message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    assert json.loads(message.content)["name"] == "get_weather"  # the call, as the model wrote it


def test_parallel_tool_calls_false_is_served(client):
    r = chat(client, CALL_ME, tools=[WEATHER], **CALL, parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


HISTORY = CALL_ME + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]


def test_a_tool_call_history_is_rendered_and_answered(client, base_url):
    r = chat(client, HISTORY, tools=[WEATHER])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = {"model": MODEL, "messages": HISTORY, "tools": [WEATHER]}
    ids = httpx.post(f"{base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    text = httpx.post(
        f"{base_url}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30
    ).json()["prompt"]
    # SmolLM2's template knows no tools: the call is rendered as the JSON its parser reads
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\n18 degrees and sunny<|im_end|>" in text
    assert "You can call these functions" in text  # the tools, in the system message
    assert r.usage.prompt_tokens == len(ids)  # /tokenize renders as the chat endpoint does


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_gives_a_call_that_validates(client, tool_choice, stream):
    """tool_choice "required" or a named function: the reply is a grammar-constrained call whose
    arguments satisfy the function's parameters, whole or streamed, finish_reason tool_calls."""
    kw = {"tools": [WEATHER], "tool_choice": tool_choice, "max_tokens": 64}
    if not stream:
        choice = chat(client, CALL_ME, **kw).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
        named = [(c.function.name, c.function.arguments) for c in calls]
    else:
        parts, finish = {}, None
        for chunk in chat(client, CALL_ME, stream=True, **kw):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name, text = parts.get(d.index, ("", ""))
                parts[d.index] = (
                    name + (d.function.name or ""),
                    text + (d.function.arguments or ""),
                )
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        named = list(parts.values())
    assert finish == "tool_calls" and named
    for name, arguments in named:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required", "tools": None}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "name"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "tokenize"),
        ({"extra_body": {"continue_final_message": True}}, "add_generation_prompt"),
        ({"extra_body": {"speculative": {"num_draft_tokens": 6}}}, "num_draft_tokens"),
        ({"extra_body": {"speculative": {"k": 1}}}, "speculative"),
    ],
)
def test_bad_tool_and_template_options_get_400(client, kw, param):
    kw = {"tools": [WEATHER]} | kw
    if kw["tools"] is None:
        del kw["tools"]
    with pytest.raises(openai.BadRequestError, match=param):
        chat(client, CALL_ME, **kw)


def test_history_message_errors_get_400(client):
    bad = [
        {"role": "user", "content": None},
        {"role": "tool", "content": "x"},  # no tool_call_id
        {"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]},
    ]
    for message in bad:
        with pytest.raises(openai.BadRequestError):
            chat(client, [message])


ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _completion(client, prompt: str, **kw) -> str:
    kw = {"max_tokens": 24, "temperature": 0} | kw
    return client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text


def test_template_controls_render_as_asked(client, base_url):
    """continue_final_message and add_generation_prompt: the reply is the raw completion of the
    prompt the template gives with them."""
    start = "The capital of France is"
    messages = ASK + [{"role": "assistant", "content": start}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    r = chat(client, messages, max_tokens=24, extra_body=body)
    system = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    )
    prompt = (
        f"{system}<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        f"<|im_start|>assistant\n{start}"
    )
    assert r.choices[0].message.content == _completion(client, prompt)
    plain = chat(client, ASK, max_tokens=1)
    bare = chat(client, ASK, max_tokens=1, extra_body={"add_generation_prompt": False})
    header = {"model": MODEL, "prompt": "<|im_start|>assistant\n"}
    count = httpx.post(f"{base_url}/tokenize", json=header, timeout=30).json()["count"]
    assert plain.usage.prompt_tokens == bare.usage.prompt_tokens + count
    kwargs = chat(client, ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.choices[0].message.content == chat(client, ASK).choices[0].message.content


def test_think_reasoning_parser(client):
    """A reply that starts thinking (the prompt opens <think>) is `reasoning` (vLLM's field, and
    `reasoning_content`, its older name, the same text) up to </think>; SmolLM2 never closes it,
    so all of it is."""
    messages = ASK + [{"role": "assistant", "content": "<think>"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    r = chat(client, messages, max_tokens=16, extra_body=body)
    message = r.choices[0].message
    deltas = [
        c.choices[0].delta.model_extra
        for c in chat(client, messages, max_tokens=16, extra_body=body, stream=True)
    ]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    streamed = "".join(d.get("reasoning") or "" for d in deltas)
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == streamed
    assert streamed and not message.content


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
ANSWER_TOOL = {"type": "function", "function": {"name": "answer", "parameters": ANSWER}}
# SmolLM2 thinks when the prompt opens <think>, and closes it (a few tokens in) when "</" is
# favoured: THINK_BIAS
QUESTION = "What is 2+2? First think step by step inside <think> </think> tags, then answer."
THINK = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "<think>"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.mark.parametrize(
    "constraint",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": ANSWER},
            }
        },
        {"tools": [ANSWER_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    ],
    ids=["response_format", "tool_choice"],
)
def test_a_grammar_starts_after_the_reasoning(client, base_url, constraint):
    """A reply that starts in reasoning is free up to </think>: its reasoning is the free reply's
    (the grammar waits); what follows is the grammar's, valid for the schema, whole and streamed
    (the engine's side, exact under speculation: test_structured)."""
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "</"}, timeout=30)
    kw = {"max_tokens": 80, "logit_bias": {str(tokens.json()["tokens"][0]): 4}}
    kw["extra_body"] = CONTINUE
    shown = {"tools": constraint["tools"], "tool_choice": "none"} if "tools" in constraint else {}
    free = chat(client, THINK, **kw, **shown).choices[0].message.model_extra["reasoning"]
    choice = chat(client, THINK, **kw, **constraint).choices[0]
    assert choice.message.model_extra["reasoning"] == free != ""
    if "tools" in constraint:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        answer = json.loads(call.function.arguments)
    else:
        assert choice.finish_reason == "stop"
        answer = json.loads(choice.message.content)
    jsonschema.validate(answer, ANSWER)
    deltas = [c.choices[0].delta for c in chat(client, THINK, **kw, **constraint, stream=True)]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == free
    if "tools" not in constraint:
        assert "".join(d.content or "" for d in deltas) == choice.message.content


def test_many_stop_strings_and_include_stop_str_in_output(client):
    text = chat(client, ASK).choices[0].message.content
    word = text.split()[3]
    stops = ["zzq1", "zzq2", "zzq3", "zzq4", "zzq5", word]
    cut = chat(client, ASK, stop=stops)
    kept = chat(client, ASK, stop=stops, extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].message.content == cut.choices[0].message.content + word
    assert text.startswith(kept.choices[0].message.content)


def test_continuous_usage_stats(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"ignore_eos": True}
    chunks = list(
        chat(client, ASK, max_tokens=12, stream=True, stream_options=options, extra_body=body)
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts)
    assert counts[-1] == 12 and len(set(counts)) > 3 and chunks[-1].usage.prompt_tokens > 10


def _metric(base_url, name: str, **labels) -> float:
    return total(scrape(base_url), name, **labels)


def test_per_request_speculation(client, base_url):
    """K=0 and K=2 give the default's greedy output; a K=0 request proposes no drafts."""
    default = chat(client, ASK).choices[0].message.content
    draft_tokens = "vllm:spec_decode_num_draft_tokens_total"
    proposed = _metric(base_url, draft_tokens)
    off = chat(client, ASK, extra_body={"speculative": {"num_draft_tokens": 0}})
    assert off.choices[0].message.content == default
    assert _metric(base_url, draft_tokens) == proposed
    two = chat(client, ASK, extra_body={"speculative": {"num_draft_tokens": 2}})
    assert two.choices[0].message.content == default
    assert _metric(base_url, draft_tokens) > proposed


def test_health_and_metrics_name_every_replica(base_url):
    health = httpx.get(f"{base_url}/health", timeout=30).json()
    assert health["status"] == "ok" and len(health["replicas"]) == 1
    [replica] = health["replicas"]
    assert _metric(base_url, "eagleserve_replicas") == 1
    assert _metric(base_url, "eagleserve_healthy", replica=replica) == 1
    steps = _metric(base_url, "eagleserve_engine_steps_total", replica=replica)
    assert steps == _metric(base_url, "eagleserve_engine_steps_total") > 0
