"""Chat messages -> prompt token ids through the model's chat template (or `--chat-template FILE`),
with the request's tools, template kwargs and generation-prompt controls."""

import json
from pathlib import Path

from jinja2 import TemplateError

from deployments.api_errors import APIError
from deployments.chat_messages import AssistantMessage, ChatMessage
from deployments.tools import tool_prompt

# apply_chat_template's own arguments: a template kwarg may not replace them
RESERVED_KWARGS = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "messages",
}


def load_template(tokenizer, path: str | None) -> str | None:
    """The template text: the file's, else the tokenizer's (None: it has none)."""
    if path is not None:
        return Path(path).read_text()
    return getattr(tokenizer, "chat_template", None) or None


def _template_call(call) -> dict:
    """An earlier call as templates expect it: arguments as an object (Hugging Face's convention;
    text that is not JSON stays text)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def _as_text(message: ChatMessage) -> dict:
    """A message for a template that knows nothing of tools: the calls as the JSON the plain-JSON
    parser reads, a tool's answer as a message of role "tool"."""
    text, tool_calls = message.text(), getattr(message, "tool_calls", None)
    if tool_calls:
        calls = [_template_call(c)["function"] for c in tool_calls]
        text += json.dumps(calls[0] if len(calls) == 1 else calls)
    return {"role": message.role, "content": text}


def to_template_messages(messages: list[ChatMessage], knows_tools: bool) -> list[dict]:
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if knows_tools:
            d = {"role": role, "content": None if m.content is None else m.text()}
            if tool_calls := getattr(m, "tool_calls", None):
                d["tool_calls"] = [_template_call(c) for c in tool_calls]
            if (call_id := getattr(m, "tool_call_id", None)) is not None:
                d["tool_call_id"] = call_id
        else:
            d = _as_text(m) | {"role": role}
        if m.name is not None:
            d["name"] = m.name
        if isinstance(m, AssistantMessage) and (reasoning := m.reasoning_text()) is not None:
            d["reasoning"] = d["reasoning_content"] = reasoning  # both names, as vLLM passes them
        out.append(d)
    return out


def _with_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The tools described in the system message (merged into the first, if any)."""
    prompt = tool_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0] | {"content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


class ChatTemplate:
    def __init__(self, tokenizer, path: str | None = None):
        self.tokenizer = tokenizer
        self.source = load_template(tokenizer, path)
        self.knows_tools = "tools" in (self.source or "")

    def render(self, req, tools: list[dict] | None = None) -> str:
        """The request's prompt text. A template that does not read `tools` gets them described in
        the system message."""
        if self.source is None:
            raise APIError(
                400, "the model has no chat template (the server takes one with --chat-template)"
            )
        messages = to_template_messages(req.messages, self.knows_tools)
        if tools and not self.knows_tools:
            messages = _with_tool_prompt(messages, tools)
        kwargs = getattr(req, "chat_template_kwargs", None) or {}
        if bad := sorted(set(kwargs) & RESERVED_KWARGS):
            raise APIError(
                400,
                f"chat_template_kwargs may not set {bad[0]!r}",
                param="chat_template_kwargs",
                code="invalid_value",
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools if self.knows_tools else None,
                chat_template=self.source,
                add_generation_prompt=getattr(req, "add_generation_prompt", True),
                continue_final_message=getattr(req, "continue_final_message", False),
                tokenize=False,
                **kwargs,
            )
        except (TemplateError, TypeError, ValueError) as e:
            raise APIError(
                400, f"the chat template failed on these messages: {e}", param="messages"
            ) from None

    def encode(self, req, tools: list[dict] | None = None) -> tuple[list[int], str]:
        """-> (prompt token ids, prompt text)."""
        text = self.render(req, tools)
        return self.tokenizer.encode(text, add_special_tokens=False), text
