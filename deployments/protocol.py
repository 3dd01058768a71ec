"""OpenAI API request and response models (the subset served), and OpenAI-style errors."""

import json
import re
import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema

from speculative.config import MAX_STOP_STRINGS, LogitBiasValue, SamplingParams, StructuredSpec


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers or {}

    def __reduce__(self):  # crosses Ray's process boundary intact
        return APIError, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def parse_json_object(body: bytes) -> dict:
    """A request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # not JSON, not UTF-8/16/32, or an integer over 4300 digits
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    # a lone surrogate escape ("\ud800") decodes but is no text: tokenizer and replies fail on it
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError(
            400,
            "request body holds a lone surrogate escape (not valid Unicode text)",
            code="invalid_json",
        ) from None
    return data


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


class SpeculativeOptions(BaseModel):
    """Our extension: speculation per request. num_draft_tokens 0 turns it off, fewer than the
    server's K lowers it; the output is exact either way."""

    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: int = Field(ge=0, le=16)


# ---- end issue 31b ----


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


# ---- structured outputs: OpenAI's response_format and vLLM's structured_outputs ----


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's extension: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")  # a JSON schema, or its text
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)  # EBNF (xgrammar's GBNF dialect)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


def structured_spec(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> StructuredSpec | None:
    """The engine's constraint for a request's response_format or structured_outputs."""
    if response_format is not None and response_format.type != "text":
        if structured is not None:
            raise APIError(
                400,
                "give either response_format or structured_outputs, not both",
                param="structured_outputs",
                code="invalid_value",
            )
        schema = response_format.json_schema and response_format.json_schema.schema_
        if schema is None:
            return StructuredSpec(kind="json_object")
        return StructuredSpec(kind="json", spec=json.dumps(schema))
    if structured is None:
        return None
    if structured.json_ is not None:
        schema = structured.json_
        return StructuredSpec(
            kind="json", spec=schema if isinstance(schema, str) else json.dumps(schema)
        )
    if structured.choice:
        return StructuredSpec(kind="choice", choices=tuple(structured.choice))
    if structured.regex or structured.grammar:
        kind = "regex" if structured.regex else "grammar"
        return StructuredSpec(kind=kind, spec=structured.regex or structured.grammar)
    return StructuredSpec(kind="json_object")


# What the validators below accept, for the OpenAPI schema (pydantic cannot derive it from them)
_NON_EMPTY = {"type": "string", "minLength": 1}
_STOP = WithJsonSchema(
    {
        "anyOf": [
            _NON_EMPTY,
            {"type": "array", "items": _NON_EMPTY, "maxItems": MAX_STOP_STRINGS},
            {"type": "null"},
        ]
    }
)
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT = WithJsonSchema(
    {
        "anyOf": [
            _NON_EMPTY,
            {"type": "array", "items": _NON_EMPTY, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ]
    }
)
TokenIds = list[Annotated[int, Strict()]]  # strict: no booleans


def _only_with(flag: str):
    """A field validator: the field may be set only when `flag` (declared before it) is true."""

    def check(cls, v, info):
        if v is not None and not info.data.get(flag):
            raise ValueError(f"{info.field_name} is only allowed when {flag} is true")
        return v

    return classmethod(check)


def _like(name: str, default=...):
    """A request field bounded as SamplingParams' field `name` is, so that the two cannot drift (a
    bound only the engine knew was a 500, not a 400)."""
    field = SamplingParams.model_fields[name]
    keys = ("ge", "gt", "le", "lt", "max_length")
    bounds = {k: getattr(m, k) for m in field.metadata for k in keys if hasattr(m, k)}
    if default is ...:
        default = field.get_default(call_default_factory=True)
    return Field(default, **bounds)


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints. Options we do not implement are refused, never ignored
    (unknown fields too: `refuse_unknown`, hence no additionalProperties in the schema)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = _like("temperature", 1.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0: greedy (SamplingParams' is above 0)
    top_k: int = _like("top_k")  # any k over the vocabulary is no cut
    min_p: float = _like("min_p")
    n: int = Field(1, ge=1, le=128)  # choices, each a request of its own (OpenAI's limit)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _STOP] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # OpenAI's int64
    presence_penalty: float = _like("presence_penalty")
    frequency_penalty: float = _like("frequency_penalty")
    repetition_penalty: float = _like("repetition_penalty")  # vLLM's extension
    min_tokens: int = _like("min_tokens")  # vLLM's extension
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = _like("stop_token_ids", None)
    logit_bias: dict[str, LogitBiasValue] | None = _like("logit_bias", None)
    user: str | None = None
    # ---- issue 31b ----
    include_stop_str_in_output: bool = False  # vLLM's
    speculative: SpeculativeOptions | None = None  # ours
    # ---- end issue 31b ----
    # structured outputs (speculative/grammar.py): OpenAI's and vLLM's forms
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI's schema lets most options be null, meaning their default, and some clients send
        them so: a null option with a non-null default takes that default."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {
                k: v
                for k, v in data.items()
                if v is not None or k not in fields or fields[k].default is None
            }
        return data

    _stream_options_need_stream = field_validator("stream_options")(_only_with("stream"))

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v):
        if v and not all(k.isascii() and k.isdigit() and len(k) <= 10 for k in v):
            raise ValueError("logit_bias keys must be token ids (non-negative integers)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings")
        return stops

    def num_logprobs(self) -> int | None:
        """None: no log-probabilities; else the sampled token's and this many top ones."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        return None

    def num_choices(self) -> int:
        return self.n

    def structured_spec(self) -> StructuredSpec | None:
        spec = structured_spec(self.response_format, self.structured_outputs)
        if spec is not None and (self.ignore_eos or self.min_tokens):
            param = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise APIError(
                400,
                f"{param} cannot be combined with structured outputs (the grammar ends the "
                "output with EOS)",
                param=param,
                code="invalid_value",
            )
        return spec

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        greedy = self.top_p == 0  # only the most likely token is left
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed % 2**63,
            max_tokens=max_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            include_stop_str_in_output=self.include_stop_str_in_output,
            num_draft_tokens=self.speculative and self.speculative.num_draft_tokens,
            structured=self.structured_spec(),
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = _like("logprobs", None)

    _top_needs_logprobs = field_validator("top_logprobs")(_only_with("logprobs"))
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


class CompletionRequest(_SamplingRequest):
    # a string, strings, token ids or lists of them: a list of prompts (see _prompts)
    prompt: Annotated[str | list[str] | TokenIds | list[TokenIds], _PROMPT]
    echo: bool = False  # the prompt before the completion, in the text and the logprobs
    max_tokens: int | None = Field(16, ge=0)  # 0: the prompt's log-probabilities only (echo)
    logprobs: Annotated[int, Strict()] | None = _like("logprobs", None)  # OpenAI's limit: 5

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


def refuse_unknown(req: _SamplingRequest) -> None:
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


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*)$|[\[\-]")


def field_path(loc: tuple) -> str:
    """A validation error's location as the request field, in the client's words: ("messages", 1,
    "content", "str") is messages[1].content (pydantic's union members, "str", are left out)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _TYPE_TAG.search(part):
            continue
        elif part.isidentifier():
            path += f".{part}" if path else part
        else:
            path += f"[{json.dumps(part)}]"
    return path


# what a field of several forms may be, for an error that fits none of them
_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "content": "a string, a list of text parts or (assistant with tool_calls) null",
    "stop": f"a string or a list of up to {MAX_STOP_STRINGS} strings",
}


def validation_error(e: ValidationError) -> APIError:
    """A 400 naming the first field that failed, in the client's words."""
    errors = e.errors()
    param = field_path(errors[0]["loc"]) or None
    form = _FORMS.get(re.sub(r"\[.*", "", (param or "").rsplit(".", 1)[-1]))
    union = any(isinstance(p, str) and _TYPE_TAG.search(p) for p in errors[0]["loc"])
    message = f"must be {form}" if form and union else errors[0]["msg"]
    message = message.removeprefix("Value error, ")
    return APIError(
        400, f"{param}: {message}" if param else message, param=param, code="invalid_value"
    )


def request_schemas() -> dict:
    """The request bodies' JSON schemas (and the models they use), as OpenAPI components."""
    models = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
    _, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    return top["$defs"]


def json_body(model: type[BaseModel]) -> dict:
    """A route's OpenAPI requestBody, for routes that parse their own body (`request_schemas`)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


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
