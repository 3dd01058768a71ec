"""A chat choice's text as OpenAI message deltas: reasoning in <think> tags (vLLM's `reasoning`,
and `reasoning_content`, its older name), tool calls (deployments/tools.py) and content. Whole
replies are their stream's deltas merged, so the two cannot differ."""

import json
import re
from functools import partial

from deployments.tools import CALL_STARTS, PARSE, call_id, constrained, parse_forced


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: held back until it is known."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ReasoningSplitter:
    """Text in and out of <think> ... </think> -> ("reasoning" | "content", text) pieces. The
    newlines right after a tag are dropped, however the stream splits them."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning, self.buffer, self.after_tag = in_reasoning, "", in_reasoning

    def _take(self, text: str) -> None:
        if self.after_tag:
            text = text.lstrip("\n")
            self.after_tag = not text
        self.buffer += text

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self._take(text)
        pieces = []
        while True:
            tag = "</think>" if self.in_reasoning else "<think>"
            kind = "reasoning" if self.in_reasoning else "content"
            before, found, after = self.buffer.partition(tag)
            if not found:
                break
            pieces.append((kind, before))
            self.in_reasoning, self.buffer, self.after_tag = not self.in_reasoning, "", True
            self._take(after)
        keep = 0 if final else _partial_tag(self.buffer, tag)
        pieces.append((kind, self.buffer[: len(self.buffer) - keep]))
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return [(k, t) for k, t in pieces if t]


def _call_deltas(index: int, call: dict) -> list[dict]:
    """OpenAI's stream of one call: its id and name first, then its arguments."""
    head = {"index": index, "id": call_id(), "type": "function"}
    head["function"] = {"name": call["name"], "arguments": ""}
    arguments = {"index": index, "function": {"arguments": call["arguments"]}}
    return [{"tool_calls": [head]}, {"tool_calls": [arguments]}]


# a call's text up to its arguments object: {"name": "...", "arguments": (or "parameters":)
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def _object_end(text: str) -> int | None:
    """The end of the JSON object or array `text` starts with; None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = ch == "\\" and not escaped, in_string and (ch != '"' or escaped)
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class ToolCallStream:
    """Content, with what may be a tool call held back until it is known. A call whose text starts
    {"name": ..., "arguments": {...  streams as it comes: its id and name, then its arguments as
    they grow (the model's own text). Other calls go out whole once parsed: Hermes' as each
    closes, plain and Llama JSON (all of a reply) at its end. A forced call (tool_choice
    "required" or named) is the whole reply."""

    def __init__(self, parser: str, is_parallel: bool, forced=None):
        self.parser, self.is_parallel, self.forced = parser, is_parallel, forced
        self.buffer, self.is_content, self.in_call, self.num_calls = "", False, False, 0
        self.args_sent = None  # the streaming call's argument characters sent; None: none streams

    def _emit(self, calls: list[dict]) -> list[dict]:
        deltas = []
        for call in calls:
            if self.num_calls and not self.is_parallel:
                break  # parallel_tool_calls false: the first call only
            deltas += _call_deltas(self.num_calls, call)
            self.num_calls += 1
        return deltas

    def _stream(self, body: str) -> list[dict]:
        """The call being written: its head once its name is known, then new argument text."""
        head = _HEAD.match(body)
        if head is None or (self.num_calls and not self.is_parallel):
            return []
        deltas, index = [], self.num_calls
        if self.args_sent is None:
            name = json.loads(f'"{head.group(1)}"')
            deltas = _call_deltas(index, {"name": name, "arguments": ""})[:1]
            self.args_sent = 0
        arguments = body[head.end() :]
        arguments = arguments[: _object_end(arguments) or len(arguments)]
        if len(arguments) > self.args_sent:
            fragment = arguments[self.args_sent :]
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            self.args_sent = len(arguments)
        return deltas

    def _close(self, body: str, calls: list[dict]) -> list[dict]:
        """A call's text is complete: the rest of the streaming one and the calls after it, or all
        `calls` when none streamed."""
        if self.args_sent is None:
            return self._emit(calls)
        deltas = self._stream(body)
        self.num_calls, self.args_sent = self.num_calls + 1, None
        return deltas + self._emit(calls[1:])

    def feed(self, text: str) -> list[dict]:
        if self.is_content:
            return [{"content": text}]
        self.buffer += text
        if self.forced is not None:
            return []
        if self.parser == "hermes":
            return self._feed_hermes()
        body = self.buffer.lstrip()
        starts = CALL_STARTS[self.parser]
        if not body or any(body.startswith(s) or s.startswith(body) for s in starts):
            return self._stream(body.removeprefix("<|python_tag|>"))
        self.is_content, self.buffer = True, ""
        return [{"content": body}]

    def _feed_hermes(self) -> list[dict]:
        deltas = []
        while True:
            tag = "</tool_call>" if self.in_call else "<tool_call>"
            before, found, after = self.buffer.partition(tag)
            if not found:
                break
            if self.in_call:
                text = f"<tool_call>{before}</tool_call>"
                _, calls = PARSE["hermes"](text)
                streaming = self.args_sent is not None
                deltas += self._close(before, calls) if calls or streaming else [{"content": text}]
            elif before.strip() or not self.num_calls:  # not the space between calls
                deltas.append({"content": before})
            self.in_call, self.buffer = not self.in_call, after
        if self.in_call:
            return deltas + self._stream(self.buffer)
        keep = _partial_tag(self.buffer, "<tool_call>")
        if self.buffer[: len(self.buffer) - keep].strip() or not self.num_calls:
            deltas.append({"content": self.buffer[: len(self.buffer) - keep]})
            self.buffer = self.buffer[len(self.buffer) - keep :]
        return [d for d in deltas if d.get("content") != ""]

    def finish(self) -> list[dict]:
        text, self.buffer = self.buffer, ""
        if self.forced is not None:
            return self._emit(parse_forced(text))
        body = text.lstrip().removeprefix("<|python_tag|>")
        if self.parser == "hermes" and self.in_call:
            text, body = f"<tool_call>{text}", text
        if not text.strip() and self.num_calls:  # the space after the last call
            return []
        content, calls = PARSE[self.parser](text)
        if self.args_sent is not None:  # announced: its text is a call, whatever else follows
            return self._close(body, calls)
        return ([{"content": content}] if content else []) + self._emit(calls)


class ChatOutput:
    """One choice's deltas. parser: a tool-call parser name, or None when tools are not parsed;
    in_reasoning: None without a reasoning parser, else whether the reply starts thinking."""

    def __init__(self, parser=None, is_parallel=True, in_reasoning=None, forced=None):
        self.reasoning = None if in_reasoning is None else ReasoningSplitter(in_reasoning)
        self.tools = ToolCallStream(parser, is_parallel, forced) if parser or forced else None

    @property
    def has_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def _content(self, text: str) -> list[dict]:
        if self.tools is None:
            return [{"content": text}] if text else []
        return self.tools.feed(text) if text else []

    def feed(self, text: str, final: bool = False) -> list[dict]:
        pieces = self.reasoning.feed(text, final) if self.reasoning else [("content", text)]
        deltas = []
        for kind, piece in pieces:
            if kind == "reasoning":  # vLLM's field, and its older name (the same text)
                deltas.append({"reasoning": piece, "reasoning_content": piece})
            else:
                deltas += self._content(piece)
        if final and self.tools is not None:
            deltas += self.tools.finish()
        return deltas


REASONING_END = "</think>"


def chat_params(params, schema: dict | None, thinking: bool | None):
    """A choice's sampling parameters: constrained to a forced call's schema, if any; a reply that
    starts in reasoning has its grammar wait for the reasoning's end (vLLM's rule)."""
    if schema is not None:
        params = constrained(params, schema)
    if thinking and params.structured is not None:
        params = params.model_copy(update={"reasoning_end": REASONING_END})
    return params


def starts_in_reasoning(prompt_text: str, reasoning_parser: str | None) -> bool | None:
    """Whether the reply starts in reasoning (a template may open the <think> itself); None
    without a reasoning parser."""
    return prompt_text.rstrip().endswith("<think>") if reasoning_parser == "think" else None


def output_maker(req, prompt_text: str, parser: str, reasoning_parser: str | None):
    """A request's ChatOutput maker (one per choice): what its reply is parsed for."""
    forced = req.tool_choice_value() if req.is_forced_tool_call() else None
    thinking = starts_in_reasoning(prompt_text, reasoning_parser)
    tool_parser = parser if req.uses_tools() and forced is None else None
    return partial(ChatOutput, tool_parser, req.parallel_tool_calls, thinking, forced)


def merged_message(deltas: list[dict]) -> dict:
    """A whole message from its deltas."""
    content, reasoning, calls = [], [], {}
    for d in deltas:
        content.append(d.get("content", ""))
        reasoning.append(d.get("reasoning", ""))
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": None, "type": "function", "function": {}})
            call["id"] = c.get("id", call["id"])
            name = c["function"].get("name")
            call["function"].setdefault("name", name)
            arguments = call["function"].get("arguments", "") + c["function"].get("arguments", "")
            call["function"]["arguments"] = arguments
    message = {"role": "assistant", "content": "".join(content) or None, "refusal": None}
    if any(reasoning):
        message["reasoning"] = message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    elif message["content"] is None:
        message["content"] = ""
    return message
