"""Tool calls in the model's words: the parsers for the formats model families use, the prompt that
shows tools to a template that does not read them, and forced calls (a grammar-constrained JSON list
of calls)."""

import json
import re
import uuid

from deployments.api_errors import APIError
from speculative.grammar import tool_call_schema

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "json")


def parser_for_template(template: str) -> str:
    """The parser a chat template's format calls for: Hermes' <tool_call> tags (Qwen), Llama
    3.1's JSON (<|python_tag|>, the ipython role), else plain JSON (the tool prompt's format)."""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "json"


def tool_prompt(tools: list[dict]) -> str:
    """The tools, for a template that does not read `tools`, asking for the plain-JSON format."""
    functions = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You can call these functions:\n"
        f"{functions}\n"
        "To call one, reply with only a JSON object: "
        '{"name": <function name>, "arguments": <an object of its arguments>}.'
    )


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj) -> dict | None:
    """{"name", "arguments" (JSON text)} from a parsed call, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        return {"name": obj["name"], "arguments": arguments}
    return {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def _calls(objs: list) -> list[dict] | None:
    calls = [_call(o) for o in objs]
    return calls if calls and all(calls) else None


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """Qwen's and Hermes' <tool_call>{"name": ..., "arguments": ...}</tool_call>, any number."""
    if "<tool_call>" not in text:
        return text, []
    try:
        objs = [json.loads(body) for body in _HERMES.findall(text)]
    except ValueError:
        return text, []
    calls = _calls(objs)
    return (text[: text.index("<tool_call>")].strip(), calls) if calls else (text, [])


def _json_values(text: str, separator: str) -> list | None:
    """The JSON values that make up all of `text`, apart by whitespace or `separator`."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
        while at < len(text) and (text[at].isspace() or text[at] == separator):
            at += 1
    return values


def parse_llama3_json(text: str) -> tuple[str, list[dict]]:
    """Llama 3.1's {"name": ..., "parameters": ...}, several apart by ";"."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = _calls(_json_values(body, ";") or [])
    return ("", calls) if calls else (text, [])


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_json(text: str) -> tuple[str, list[dict]]:
    """Plain JSON: a call object or a list of them (in a ```json fence or not), the whole reply."""
    body = text.strip()
    body = m.group(1) if (m := _FENCE.match(body)) else body
    if not body.startswith(("{", "[")):
        return text, []
    values = _json_values(body, ";") or []
    objs = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    calls = _calls(objs)
    return ("", calls) if calls else (text, [])


PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "json": parse_json}
# what a reply that may be a tool call starts with: its content is held back until it is known
CALL_STARTS = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("{", "<|python_tag|>"),
    "json": ("{", "[", "```"),
}


def forced_tool_call_schema(tools: list[dict], tool_choice, parallel: bool = True) -> dict | None:
    """tool_choice "required" or a named function: the JSON schema the reply is constrained to
    (a list of {"name", "arguments"}, speculative/grammar.py); None for "none" and "auto"."""
    if tool_choice in (None, "none", "auto"):
        return None
    try:
        return tool_call_schema(tools, tool_choice, parallel)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice", code="invalid_value") from None


def constrained(params, schema: dict):
    """The sampling parameters with the reply constrained to the schema (validated again: a
    constraint cannot go with ignore_eos or min_tokens)."""
    structured = {"kind": "json", "spec": json.dumps(schema)}
    return type(params).model_validate(params.model_dump() | {"structured": structured})


def parse_forced(text: str) -> list[dict]:
    """The calls in a reply constrained by `forced_tool_call_schema`: a JSON list of them."""
    try:
        return _calls(json.loads(text)) or []
    except ValueError:
        return []
