"""Property-based fuzzing of the HTTP endpoint (a tiny random model, one replica): schemathesis
drives every operation of the app's own OpenAPI schema with schema-valid and schema-violating
requests, and hypothesis sends malformed bodies (random bytes, wrong types, out-of-range and huge
numbers, invalid Unicode, deep nesting). No request may get a 5xx or take the replica down:
afterwards the same replica answers a normal chat request exactly as before. Oversized bodies get
413, over-long prompts 400."""

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve
from schemathesis.checks import not_a_server_error
from serve_app import start_app, stop_app
from tiny_models import tiny_llama

from deployments.config import ServeConfig

MODEL = "tiny"
MAX_BODY = 8192
MAX_MODEL_LEN = 48
POSITIONS = 46  # the model's own limit, under MAX_MODEL_LEN: the server serves 46
FUZZ = settings(
    max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model = str(
        tiny_llama(tmp_path_factory.mktemp("fuzz") / "tiny", layers=2, max_positions=POSITIONS)
    )
    cfg = ServeConfig(
        engine={
            "model": model,
            "drafter": "none",
            "max_batch_size": 8,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": 256,
            "device": "cpu",
        },
        served_model_name=MODEL,
        max_request_bytes=MAX_BODY,
    )
    url = start_app(cfg, num_cpus=2)
    yield {"url": url, "handle": serve.get_deployment_handle("LLMServer", app_name="eagleserve")}
    stop_app()


def _chat(url) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def before(app):
    """The greedy answer and the replica's process before any fuzzing."""
    return {
        "text": _chat(app["url"]),
        "pid": app["handle"].replica_info.remote().result(timeout_s=30)["pid"],
    }


def _post(url, path, content, headers=None):
    return httpx.post(
        f"{url}{path}",
        content=content,
        timeout=60,
        headers={"Content-Type": "application/json", **(headers or {})},
    )


def _assert_openai_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_openapi_schema_declares_the_request_bodies(app, before):
    spec = httpx.get(f"{app['url']}/openapi.json", timeout=30).json()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        assert "model" in spec["components"]["schemas"][model]["required"]


# ---- explicit limits ----


def test_oversized_body_gets_413(app):
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY})
    error = _assert_openai_error(_post(app["url"], "/v1/completions", big), 413)
    assert error["code"] == "request_too_large" and str(MAX_BODY) in error["message"]


def test_oversized_chunked_body_gets_413(app):
    """No Content-Length to refuse by: the body is read only up to the limit."""
    chunks = (b'{"model": "tiny", "prompt": "' + b"x" * 1024 for _ in range(64))
    r = httpx.post(
        f"{app['url']}/v1/completions",
        content=chunks,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert _assert_openai_error(r, 413)["code"] == "request_too_large"


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 200}]}),
        ("/v1/completions", {"prompt": "hello " * 200}),
        ("/v1/completions", {"prompt": [7] * MAX_MODEL_LEN}),
    ],
    ids=["chat", "completion", "token-ids"],
)
def test_prompt_over_max_model_len_gets_400(app, path, body):
    """The limit is the model's positions where they are fewer than max_model_len, and the error
    names the parameter that holds the prompt."""
    error = _assert_openai_error(_post(app["url"], path, json.dumps({"model": MODEL, **body})), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == (
        "messages" if "chat" in path else "prompt"
    )
    assert (
        f"the maximum context is {POSITIONS}" in error["message"] and "tokens" in error["message"]
    )


@pytest.mark.parametrize("length", [{}, {"max_tokens": None, "max_completion_tokens": None}])
def test_without_max_tokens_the_reply_fills_the_models_context(app, length):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}
    body |= length
    r = httpx.post(f"{app['url']}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert (
        r.json()["usage"]["total_tokens"] == POSITIONS
        and r.json()["choices"][0]["finish_reason"] == "length"
    )


# ---- schemathesis over the app's OpenAPI schema ----


@pytest.fixture(scope="module")
def api_schema(app, before):
    return schemathesis.openapi.from_url(f"{app['url']}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schemathesis.check
def openai_error_body(ctx, response, case):
    """Every refusal carries an OpenAI-style error body."""
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error


@schema.parametrize()
@FUZZ
def test_fuzzed_requests_get_no_server_error(case, app):
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL  # past the model check, into prompt handling and generation
        if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
            # an unset (or null) length fills the context (test_without_max_tokens_...): here
            # 4 tokens reach the same generation paths at a tenth of each valid request's cost
            case.body["max_tokens"] = 4
    case.call_and_validate(
        base_url=app["url"], checks=[not_a_server_error, openai_error_body], timeout=60
    )


# ---- malformed bodies: a valid request with a few fields replaced, or no request at all ----

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=8,
)
_numbers = (
    st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | st.sampled_from(
        [0, -1, 2**31, 2**63, 2**64, 10**30, 1e-45, 1e308, float("inf"), float("nan")]
    )
)
_text = st.text(max_size=40) | st.sampled_from(
    ["", "\ud800", "a\udfffb", "\x00", "\u202e", "<|im_end|>"]
)
# constraints that do not compile, compile slowly, or match nothing a model can end
_NASTY_CONSTRAINTS = [
    "(",
    "a{50000}",
    "[z-a]",
    "\\",
    "root ::= root",
    'root ::= "a" root',
    {"type": "foo"},
    {"$ref": "#"},
    {"type": "string", "pattern": "a{1001}"},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "array", "minItems": 100000},
    {"enum": []},
    {"not": {}},
]
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", 3]),
        "content": _text
        | _json
        | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _text}),
            max_size=2,
        ),
    }
)
# ---- issue 31b's fields: tools, tool-call history, template controls, per-request K ----
_tool = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "x"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "get_weather", "", "a b"]) | _text, "parameters": _json}
        ),
    }
)
_tool_call = st.fixed_dictionaries(
    {
        "id": _text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": _text, "arguments": _text | _json}),
    }
)
_history_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["assistant", "tool", "user"]), "content": st.none() | _text},
    optional={
        "tool_calls": st.lists(_tool_call, max_size=2) | _json,
        "tool_call_id": _text,
        "name": _text | _json,
    },
)
_NEW_FIELDS = {
    "tools": st.lists(_tool, max_size=2) | _json,
    "tool_choice": st.sampled_from(["none", "auto", "required", "x"])
    | st.fixed_dictionaries({"type": st.just("function"), "function": _json})
    | _json,
    "parallel_tool_calls": _json,
    "chat_template_kwargs": _json | st.sampled_from([{"tokenize": True}, {"messages": []}]),
    "add_generation_prompt": _json,
    "continue_final_message": _json,
    "include_stop_str_in_output": _json,
    "speculative": _json | st.fixed_dictionaries({"num_draft_tokens": _numbers}),
    "stream_options": _json
    | st.fixed_dictionaries({"include_usage": _json, "continuous_usage_stats": _json}),
    "messages": st.lists(_message | _history_message, min_size=1, max_size=3),
}
_FIELDS = {
    "model": _text | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "prompt": _text | st.lists(_numbers, max_size=4) | st.lists(_text, max_size=2) | _json,
    "temperature": _numbers | _json,
    "top_p": _numbers,
    "top_k": _numbers,
    "seed": _numbers,
    "max_tokens": _numbers,
    "max_completion_tokens": _numbers,
    "n": _numbers,
    "stop": _text | st.lists(_text, max_size=5) | _json,
    "stream": st.booleans() | _json,
    "stream_options": _json,
    "logprobs": _json | _numbers,
    "top_logprobs": _numbers,
    "echo": _json,
    "ignore_eos": _json,
    "user": _json,
    "tools": _json,
    "response_format": _json
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml", 1])},
        optional={"json_schema": _json | st.fixed_dictionaries({"name": _text, "schema": _json})},
    ),
    "structured_outputs": _json
    | st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]),
        _text | _json | st.lists(_text, max_size=3) | st.sampled_from(_NASTY_CONSTRAINTS),
        max_size=2,
    ),
}
_FIELDS_31B = _FIELDS | _NEW_FIELDS
_BASE = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    },
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 4},
}


def _bodies(path, fields=_FIELDS):
    names = st.lists(
        st.sampled_from(list(fields)) | st.text(max_size=8), min_size=1, max_size=3, unique=True
    )
    replaced = names.flatmap(
        lambda ns: st.fixed_dictionaries({n: fields.get(n, _json) for n in ns})
    )
    return (
        replaced.map(lambda fields: json.dumps(_BASE[path] | fields).encode())
        | st.binary(max_size=300)
        | st.integers(1, 2000).map(lambda depth: b"[" * depth + b"]" * depth)
    )


@pytest.mark.parametrize("path", list(_BASE))
def test_malformed_bodies_get_no_server_error(app, path):
    @FUZZ
    @given(body=_bodies(path))
    def check(body):
        r = _post(app["url"], path, body)
        assert r.status_code < 500, (body[:200], r.status_code, r.text[:500])
        if r.status_code >= 400:
            _assert_openai_error(r, r.status_code)

    check()


def test_new_fields_get_no_server_error(app):
    """Tools, tool-call histories, template controls, stop options and per-request K, valid and
    not, on the chat endpoint."""

    @FUZZ
    @given(body=_bodies("/v1/chat/completions", _FIELDS_31B))
    def check(body):
        r = _post(app["url"], "/v1/chat/completions", body)
        assert r.status_code < 500, (body[:300], r.status_code, r.text[:500])
        if r.status_code >= 400:
            _assert_openai_error(r, r.status_code)

    check()


# what the fuzzing found (500s, and a 503 that took the replica's engine down): JSON members added
# to (or replacing, the last of duplicate keys wins) those of a valid request, the same or one per
# path
FOUND = {
    "deep nesting": '"user": ' + "[" * 1500 + "]" * 1500,  # RecursionError in json.loads
    "5001-digit integer": '"seed": 1' + "0" * 5000,  # ValueError in json.loads
    "lone surrogate": {
        "/v1/chat/completions": '"messages": [{"role": "user", "content": "\\ud800"}]',
        "/v1/completions": '"prompt": "\\ud800"',
    },  # TypeError in the tokenizer
    "top_k over int64": '"top_k": 18446744073709551616',  # failed the step on the workers
    "uncompilable schema": '"response_format": {"type": "json_schema", "json_schema": '
    '{"name": "x", "schema": {"type": "foo"}}}',
    "slow regex": '"structured_outputs": {"regex": "a{50000}"}',
}


@pytest.mark.parametrize("member", list(FOUND.values()), ids=list(FOUND))
@pytest.mark.parametrize("path", list(_BASE))
def test_found_by_fuzzing_gets_400(app, path, member):
    member = member if isinstance(member, str) else member[path]
    body = json.dumps(_BASE[path])[:-1] + ", " + member + "}"
    _assert_openai_error(_post(app["url"], path, body), 400)


def test_tiny_temperature_decodes_greedily(app):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 6}
    texts = [
        _post(app["url"], "/v1/completions", json.dumps(body | {"temperature": t})).json()[
            "choices"
        ][0]["text"]
        for t in (0, 1e-45, 1e-6)
    ]
    assert texts == [texts[0]] * 3


def test_replica_survives_fuzzing_and_answers_as_before(app, before):
    assert _chat(app["url"]) == before["text"]
    assert app["handle"].replica_info.remote().result(timeout_s=30)["pid"] == before["pid"]
    assert httpx.get(f"{app['url']}/health", timeout=30).status_code == 200
