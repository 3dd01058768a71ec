"""A chat request's conversation and tools: messages (with an assistant's earlier tool calls and
the tool messages that answer them), the tool definitions and a named tool choice."""

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


# ---- issue 31b: tool calls in the history, tool messages, names ----


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # passed to the chat template
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template takes them."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


# ---- end issue 31b ----
