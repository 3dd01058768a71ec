"""OpenAI API request models of the endpoints served (the subset of OpenAI's options they
implement; the rest refused, never ignored), and the ids and usage of responses."""

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from deployments.api_errors import APIError
from deployments.chat_messages import ChatMessage, NamedToolChoice, Tool, tool_dicts
from deployments.sampling_request import (
    NON_EMPTY_STRING,
    SamplingRequest,
    TokenIds,
    only_with,
    sampling_field,
)

# What CompletionRequest._prompts accepts, for the OpenAPI schema (pydantic cannot derive it)
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT = WithJsonSchema(
    {
        "anyOf": [
            NON_EMPTY_STRING,
            {"type": "array", "items": NON_EMPTY_STRING, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ]
    }
)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("logprobs", None)

    _top_needs_logprobs = field_validator("top_logprobs")(only_with("logprobs"))
    # ---- issue 31b: tools and chat template controls ----
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # passed to the template (e.g. enable_thinking)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply goes on from the last (assistant) message

    @model_validator(mode="after")
    def _check_chat_controls(self):
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            t.function.name for t in self.tools or []
        }:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def uses_tools(self) -> bool:
        """The reply is parsed for tool calls (tool_choice none: tools are shown, never called)."""
        return bool(self.tools) and self.tool_choice != "none"

    def is_forced_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def tool_dicts(self) -> list[dict] | None:
        return tool_dicts(self.tools)

    def tool_choice_value(self) -> str | dict | None:
        """tool_choice as JSON values: a string, or a named function's object."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    # ---- end issue 31b ----

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    # a string, strings, token ids or lists of them: a list of prompts (see _prompts)
    prompt: Annotated[str | list[str] | TokenIds | list[TokenIds], _PROMPT]
    echo: bool = False  # the prompt before the completion, in the text and the logprobs
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt's log-probabilities only (echo)
    # OpenAI's limit: 5
    logprobs: Annotated[int, Strict()] | None = sampling_field("logprobs", None)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def num_choices(self) -> int:
        return self.n * len(self.prompt)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        """The prompts, each a string or token ids, each with its own n choices (prompt i's choice
        j has index i * n + j, as in OpenAI's API)."""
        if isinstance(v, str) or v and isinstance(v[0], int):
            v = [v]
        if not v or not all(v):
            raise ValueError("a prompt is empty")
        return v


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, encoded as /v1/completions does, or chat messages,
    encoded as /v1/chat/completions does (the template and the assistant's turn)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # ---- issue 31b: rendered as the chat endpoint renders them ----
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def tool_dicts(self) -> list[dict] | None:
        return tool_dicts(self.tools)

    # ---- end issue 31b ----

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[Annotated[int, Strict()]]


KNOWN_FIELDS = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
# OpenAI's options we do not implement, and the values of each that ask for what we do anyway
NO_OP_VALUES = {
    "metadata": [{}],
    "store": [False],
    "service_tier": ["auto", "default"],
    "suffix": [""],
    "best_of": [1],
    "prediction": [],
    "modalities": [["text"]],
    "reasoning_effort": [],
    "audio": [],
    "web_search_options": [],
}


def _same(a, b) -> bool:
    """Equal as JSON values (1 == True in Python, not in JSON)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def refuse_unknown(req: SamplingRequest) -> None:
    """Unsupported options with a value that would change behaviour are refused; unknown fields
    too."""
    for name, value in (req.model_extra or {}).items():
        no_ops = [None] + NO_OP_VALUES.get(name, [])
        if name in NO_OP_VALUES and any(_same(value, v) for v in no_ops):
            continue
        if name == "best_of" and _same(value, req.n):  # as many as are returned: no choice made
            continue
        raise APIError(
            400, f"unsupported parameter {name!r}", param=name, code="unsupported_parameter"
        )


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now() -> int:
    return int(time.time())
