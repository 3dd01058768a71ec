"""A chat request's conversation and tools: a message per role with the fields OpenAI defines for
it (and vLLM's `reasoning` on the assistant's), an assistant's earlier tool calls and the tool
messages that answer them, the tool definitions and a named tool choice. Every object refuses a key
it does not define, as the request's top level does (deployments/api_errors.py names it)."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return data


Content = str | list[TextPart]

# ---- issue 31b: tool calls in the history, tool messages, names ----


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _Message(_Strict):
    content: Content
    name: str | None = None  # passed to the chat template (vLLM takes it for every role)

    def text(self) -> str:
        if self.content is None:
            return ""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None  # the assistant's earlier calls
    # vLLM's: the reply's reasoning, for templates that show it (and its older name)
    reasoning: str | None = None
    reasoning_content: str | None = None
    # OpenAI's, which ask for nothing when null (an earlier reply's message sent back has them)
    refusal: None = None
    audio: None = None
    function_call: None = None

    @field_validator("refusal", "audio", "function_call", mode="before")
    @classmethod
    def _null_only(cls, v, info):
        if v is not None:
            raise ValueError(f"{info.field_name} is not supported in messages (only null)")
        return v

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return self

    def reasoning_text(self) -> str | None:
        return self.reasoning if self.reasoning is not None else self.reasoning_content


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str  # the call this message answers


# the role picks the model, so an error names the message's own fields (its tag, the role, is
# left out of the error's location: api_errors.field_path)
ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template takes them."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


# ---- end issue 31b ----
