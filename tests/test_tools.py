"""Tool-call parsers, the <think> reasoning splitter and chat template rendering, on CPU without a
server (the API tests are in test_tools_api.py)."""

import json

import pytest
from pydantic import ValidationError

from deployments.chat_output import ChatOutput, merged_message
from deployments.chat_template import ChatTemplate
from deployments.config import ServeConfig
from deployments.protocol import ChatCompletionRequest
from deployments.tools import parse_hermes, parse_json, parse_llama3_json, parser_for_template
from workers.models.loader import load_tokenizer, resolve_model

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ARGS = json.dumps(CALL["arguments"])


def _deltas(text: str, step: int, parser=None, **kw) -> list[dict]:
    output = ChatOutput(parser, **kw)
    deltas = []
    for i in range(0, len(text), step):
        deltas += output.feed(text[i : i + step])
    return deltas + output.feed("", final=True)


def _message(text: str, parser=None, **kw) -> dict:
    """The reply's message, checked to be the same whatever the stream's chunking."""
    whole = merged_message(ChatOutput(parser, **kw).feed(text, final=True))
    for step in (1, 2, 5, 13):
        streamed = merged_message(_deltas(text, step, parser, **kw))
        for call in streamed.get("tool_calls", []) + whole.get("tool_calls", []):
            call["id"] = "x"
        assert streamed == whole, (step, streamed, whole)
    return whole


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", [])
    ]


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        ("hermes", f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", None, 1),
        ("hermes", f"Let me look.\n<tool_call>{json.dumps(CALL)}</tool_call>", "Let me look.\n", 1),
        ("hermes", f"<tool_call>{json.dumps(CALL)}</tool_call>\n" * 2, None, 2),
        ("hermes", f"<tool_call>{json.dumps(CALL)}", None, 1),  # cut off before the tag closes
        ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", 0),
        ("hermes", "a < b and <tool", "a < b and <tool", 0),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS + "}",
            None,
            1,
        ),
        ("llama3_json", '{"name": "get_weather", "parameters": ' + ARGS + "}; " * 1, None, 1),
        ("json", json.dumps(CALL), None, 1),
        ("json", f"```json\n{json.dumps([CALL, CALL])}\n```", None, 2),
        ("json", '{"name": "get_weather", "parameters": ' + ARGS + "}", None, 1),
        ("json", "{ not a call }", "{ not a call }", 0),
        ("json", '{"city": "Paris"}', '{"city": "Paris"}', 0),  # JSON, but no call
        ("json", "Plain {text}", "Plain {text}", 0),
    ],
)
def test_parsers_whole_and_streamed(parser, text, content, calls):
    message = _message(text, parser)
    assert message["content"] == content
    assert _calls(message) == [("get_weather", CALL["arguments"])] * calls


def test_parallel_tool_calls_false_keeps_the_first():
    text = f"<tool_call>{json.dumps(CALL)}</tool_call><tool_call>{json.dumps(CALL)}</tool_call>"
    assert len(_message(text, "hermes", is_parallel=False)["tool_calls"]) == 1


def test_streamed_call_sends_id_and_name_first():
    deltas = [d for d in _deltas(json.dumps(CALL), 3, "json") if "tool_calls" in d]
    head, *rest = [d["tool_calls"][0] for d in deltas]
    assert head["id"].startswith("call_") and head["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert "".join(d["function"]["arguments"] for d in rest) == ARGS
    assert len(rest) > 3  # the arguments as they grow, not at the end
    assert all("id" not in d and "name" not in d["function"] for d in rest)


def test_module_parsers_directly():
    assert parse_hermes("no calls") == ("no calls", [])
    assert parse_llama3_json("hello") == ("hello", [])
    assert parse_json('[{"name": "f"}]') == ("", [{"name": "f", "arguments": "{}"}])


@pytest.mark.parametrize(
    "text, in_reasoning, reasoning, content",
    [
        ("<think>\nhmm, 2+2</think>\n\nIt is 4.", False, "hmm, 2+2", "It is 4."),
        ("hmm</think>4", True, "hmm", "4"),
        ("still thinking", True, "still thinking", ""),
        ("no thoughts", False, None, "no thoughts"),
        ("a <thin", False, None, "a <thin"),
    ],
)
def test_think_reasoning(text, in_reasoning, reasoning, content):
    message = _message(text, in_reasoning=in_reasoning)
    assert message.get("reasoning") == reasoning and message["content"] == content
    assert message.get("reasoning_content") == reasoning  # the older name, the same text


def test_reasoning_then_a_tool_call():
    text = f"<think>I need the weather</think><tool_call>{json.dumps(CALL)}</tool_call>"
    message = _message(text, "hermes", in_reasoning=False)
    assert message["reasoning"] == "I need the weather" and message["content"] is None
    assert _calls(message) == [("get_weather", CALL["arguments"])]


@pytest.mark.parametrize(
    "template, parser",
    [
        ("{% if tools %}<tools>{% endif %}<tool_call>", "hermes"),
        ("<|python_tag|>{{ tools }}", "llama3_json"),
        ("{{ messages }}", "json"),
    ],
)
def test_parser_chosen_from_the_template(template, parser):
    assert parser_for_template(template) == parser


# A Qwen-like template: tools, earlier calls (arguments as an object) and names reach it
QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m"))


def test_a_template_file_gets_tools_history_names_and_kwargs(tokenizer, tmp_path):
    path = tmp_path / "qwen_like.jinja"
    path.write_text(QWEN_LIKE)
    template = ChatTemplate(tokenizer, str(ServeConfig(chat_template=str(path)).chat_template))
    assert template.knows_tools and parser_for_template(template.source) == "hermes"
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    req = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": "Weather?", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
        chat_template_kwargs={"enable_thinking": False},
    )
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    # (Hugging Face renders with trim_blocks: a newline after a block tag is dropped)
    assert template.render(req, tools) == (
        "<tools>get_weather;</tools>\n<|im_start|>user(ann)Weather?<|im_end|>\n"
        "<|im_start|>assistant<tool_call>get_weather Paris</tool_call><|im_end|>\n"
        "<|im_start|>tool18C<|im_end|>\n<|im_start|>assistant\n<think></think>"
    )


def test_an_earlier_replys_reasoning_reaches_the_template(tokenizer, tmp_path):
    """An assistant message's `reasoning` (vLLM's) or `reasoning_content` (its older name) goes to
    the template under both names, as vLLM passes it (Qwen 3's template reads the older one)."""
    path = tmp_path / "reasoning.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m.reasoning }}|{{ m.reasoning_content }}]{% endfor %}"
    )
    template = ChatTemplate(tokenizer, str(path))
    for key in ("reasoning", "reasoning_content"):
        reply = {"role": "assistant", "content": "4", key: "2+2"}
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}, reply])
        assert template.render(req) == "[|][2+2|2+2]"


def test_a_missing_template_file_is_a_config_error(tmp_path):
    with pytest.raises(ValidationError, match="not a file"):
        ServeConfig(chat_template=str(tmp_path / "none.jinja"))


@pytest.mark.parametrize(
    "forced", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_forced_replies_are_read_as_calls(forced):
    """tool_choice named or "required": the constrained reply (a JSON list of calls, the shape
    speculative/grammar.py's tool_call_schema allows) is the call."""
    text = json.dumps([{"name": "get_weather", "arguments": CALL["arguments"]}])
    message = _message(text, forced=forced)
    assert message["content"] is None
    assert _calls(message) == [("get_weather", CALL["arguments"])]


@pytest.mark.parametrize("parser", ["hermes", "json", "llama3_json"])
def test_streamed_arguments_are_the_models_text(parser):
    """Braces and quotes inside strings do not end the arguments; they are the model's own text."""
    arguments = '{"q": "a \\"}\\" b {", "n": [1, {"x": 2}]}'
    call = f'{{"name": "search", "arguments": {arguments}}}'
    text = f"<tool_call>{call}</tool_call>" if parser == "hermes" else call
    message = _message(text, parser)
    [tool_call] = message["tool_calls"]
    assert tool_call["function"] == {"name": "search", "arguments": arguments}
    assert json.loads(arguments)["q"] == 'a "}" b {'
