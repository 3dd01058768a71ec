"""Structured outputs over the real server (SmolLM2 with its drafter), with the official openai
client: response_format json_object and json_schema (also through the client's `parse`), vLLM's
structured_outputs json / regex / choice / grammar, a forced tool call's grammar, refusals that
name the problem, and greedy constrained output equal to plain decoding's without the drafter."""

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from serve_app import start_app, stop_app

from deployments.config import ServeConfig
from speculative.grammar import tool_call_schema

MODEL = "smollm2-135m"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def client():
    cfg = ServeConfig(engine={"max_batch_size": 8, "max_model_len": 512, "dtype": "float32"})
    url = start_app(cfg, num_cpus=3)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    stop_app()


def ask(client, question: str, max_tokens: int = 64, **kw) -> str:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )
    assert r.choices[0].finish_reason == "stop", r
    return r.choices[0].message.content


def test_response_format_json_object(client):
    question = "Describe a cat as a JSON object with name and color."
    text = ask(client, question, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict)


def test_response_format_json_schema(client):
    schema = {"name": "person", "schema": PERSON, "strict": True}
    text = ask(
        client,
        "Describe a person.",
        response_format={"type": "json_schema", "json_schema": schema},
    )
    jsonschema.validate(json.loads(text), PERSON)


def test_parse_with_a_pydantic_model(client):
    class Person(BaseModel):
        name: str
        age: int

    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        max_tokens=64,
        temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, Person)


@pytest.mark.parametrize(
    "structured, check",
    [
        ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t) or 1 / 0),
        ({"choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative") or 1 / 0),
        (
            {"grammar": 'root ::= "The answer is " [0-9]+ "."'},
            lambda t: re.fullmatch(r"The answer is \d+\.", t) or 1 / 0,
        ),
        ({"json_object": True}, lambda t: json.loads(t)),
    ],
    ids=["json", "regex", "choice", "grammar", "json_object"],
)
def test_structured_outputs(client, structured, check):
    check(ask(client, "What is 12 + 30? Answer.", extra_body={"structured_outputs": structured}))


def test_completions_and_streaming_follow_the_grammar(client):
    r = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}},
    )
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=64,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ask(
        client,
        "Describe a person.",
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )


def test_forced_tool_call_grammar_gives_arguments_that_validate(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = tool_call_schema([WEATHER], named, parallel=False)
    text = ask(
        client,
        "What is the weather like in Paris?",
        max_tokens=80,
        extra_body={"structured_outputs": {"json": schema}},
    )
    (call,) = json.loads(text)
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({"structured_outputs": {"json": {"type": "foo"}}}, 'Unsupported type \\\\?"foo'),
        ({"structured_outputs": {"regex": "(ab"}}, "parenthesis is not closed"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, 'Rule \\\\?"nope'),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"json": {}, "whitespace": 1}}, "whitespace"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_constraints_get_400_naming_the_problem(client, extra, reason):
    with pytest.raises(openai.BadRequestError, match=reason):
        ask(client, "Hi", extra_body=extra)
    r = client.chat.completions.create(  # the server goes on serving; "text" asks for nothing
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        response_format={"type": "text"},
    )
    assert r.usage.completion_tokens > 0


def test_greedy_constrained_with_drafter_equals_plain_decoding(client):
    """The server runs SmolLM2 with its drafter; the same requests decoded here without one."""
    from conftest import _smollm2

    from speculative.config import SamplingParams, StructuredSpec
    from speculative.engine.llm_engine import encode_prompt

    questions = ["Describe a person.", "Describe another person, older."]
    served = [
        ask(
            client,
            q,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        )
        for q in questions
    ]
    plain = _smollm2("none")
    params = SamplingParams(
        max_tokens=64, structured=StructuredSpec(kind="json", spec=json.dumps(PERSON))
    )
    prompts = [encode_prompt(plain.tokenizer, q) for q in questions]
    decoded = [
        plain.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        for r in plain.generate(prompts, params)
    ]
    assert served == decoded
