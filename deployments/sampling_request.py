"""The sampling options both generation endpoints share (SamplingRequest), each bounded as the
engine's SamplingParams bounds it, and the SamplingParams a request asks for."""

from functools import partial
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
from deployments.structured_outputs import ResponseFormat, StructuredOutputs, structured_spec
from speculative.config import MAX_STOP_STRINGS, LogitBiasValue, SamplingParams, StructuredSpec


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far
    include_obfuscation: bool | None = None  # OpenAI's: false asks for what we do

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, v):
        if v:
            raise ValueError("true is not supported (the chunks carry no obfuscation field)")
        return v


# ---- issue 31b ----


class SpeculativeOptions(BaseModel):
    """Our extension: speculation per request. num_draft_tokens 0 turns it off, fewer than the
    server's K lowers it, "auto" lets the engine pick each step's; the output is exact either
    way."""

    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: Annotated[int, Field(ge=0, le=16)] | Literal["auto"]


# ---- end issue 31b ----


# What the validators below accept, for the OpenAPI schema (pydantic cannot derive it from them)
NON_EMPTY_STRING = {"type": "string", "minLength": 1}
_STOP = WithJsonSchema(
    {
        "anyOf": [
            NON_EMPTY_STRING,
            {"type": "array", "items": NON_EMPTY_STRING, "maxItems": MAX_STOP_STRINGS},
            {"type": "null"},
        ]
    }
)
TokenIds = list[Annotated[int, Strict()]]  # strict: no booleans


def only_with(flag: str):
    """A field validator: the field may be set only when `flag` (declared before it) is true."""

    def check(cls, v, info):
        if v is not None and not info.data.get(flag):
            raise ValueError(f"{info.field_name} is only allowed when {flag} is true")
        return v

    return classmethod(check)


def sampling_field(name: str, default=...):
    """A request field bounded as SamplingParams' field `name` is, so that the two cannot drift (a
    bound only the engine knew was a 500, not a 400)."""
    field = SamplingParams.model_fields[name]
    keys = ("ge", "gt", "le", "lt", "max_length")
    bounds = {k: getattr(m, k) for m in field.metadata for k in keys if hasattr(m, k)}
    if default is ...:
        default = field.get_default(call_default_factory=True)
    return Field(default, **bounds)


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints. Options we do not implement are refused, never ignored
    (unknown fields too: `refuse_unknown`, hence no additionalProperties in the schema)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = sampling_field("temperature", 1.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0: greedy (SamplingParams' is above 0)
    top_k: int = sampling_field("top_k")  # any k over the vocabulary is no cut
    min_p: float = sampling_field("min_p")
    n: int = Field(1, ge=1, le=128)  # choices, each a request of its own (OpenAI's limit)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, _STOP] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # OpenAI's int64
    presence_penalty: float = sampling_field("presence_penalty")
    frequency_penalty: float = sampling_field("frequency_penalty")
    repetition_penalty: float = sampling_field("repetition_penalty")  # vLLM's extension
    min_tokens: int = sampling_field("min_tokens")  # vLLM's extension
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = sampling_field("stop_token_ids", None)
    logit_bias: dict[str, LogitBiasValue] | None = sampling_field("logit_bias", None)
    user: str | None = None
    # ---- issue 31b ----
    include_stop_str_in_output: bool = False  # vLLM's
    speculative: SpeculativeOptions | None = None  # ours
    # ---- end issue 31b ----
    # vLLM's: lower is served earlier, under --scheduling-policy priority only
    priority: Annotated[int, Strict()] = sampling_field("priority")
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

    _stream_options_need_stream = field_validator("stream_options")(only_with("stream"))

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

    def check_priority(self, policy: str) -> None:
        """As vLLM documents the field: a priority other than 0 needs the priority policy."""
        if self.priority and policy != "priority":
            raise APIError(
                400,
                f"priority {self.priority} needs the priority scheduling policy "
                f"(--scheduling-policy priority); this server's is {policy}",
                param="priority",
                code="invalid_value",
            )

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

    def _or_default(self, name: str, defaults: dict):
        """The field's value; left unset, the model's default (deployments/generation_config.py)
        where it has one."""
        if name in self.model_fields_set or name not in defaults:
            return getattr(self, name)
        return defaults[name]

    def sampling_params(self, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """The engine's parameters; `defaults`: the model's own, for the fields left unset."""
        value = partial(self._or_default, defaults=defaults or {})
        top_p = value("top_p")
        greedy = top_p == 0  # only the most likely token is left
        return SamplingParams(
            temperature=0.0 if greedy else value("temperature"),
            top_p=1.0 if greedy else top_p,
            top_k=value("top_k"),
            min_p=value("min_p"),
            seed=None if self.seed is None else self.seed % 2**63,
            max_tokens=max_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=value("repetition_penalty"),
            min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            include_stop_str_in_output=self.include_stop_str_in_output,
            num_draft_tokens=self.speculative and self.speculative.num_draft_tokens,
            structured=self.structured_spec(),
            priority=self.priority,
        )
