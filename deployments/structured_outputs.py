"""Structured outputs as requests ask for them: OpenAI's response_format and vLLM's
structured_outputs, and the engine's constraint (StructuredSpec) for either."""

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.api_errors import APIError
from speculative.config import StructuredSpec


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
