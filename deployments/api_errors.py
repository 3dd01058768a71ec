"""OpenAI-style errors: the exception every refusal raises (status, message, param, code, as
OpenAI's error body has them), and the 400s for a body that is no JSON object or fails validation,
naming the field in the client's words."""

import json
import re

from pydantic import ValidationError

from deployments.chat_messages import ROLES
from speculative.config import MAX_STOP_STRINGS


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


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*)$|[\[\-]")


def field_path(loc: tuple) -> str:
    """A validation error's location as the request field, in the client's words: ("messages", 1,
    "user", "content", "str") is messages[1].content (pydantic's union members, "str", and a
    message's tag, its role, are left out)."""
    path, after_index = "", False
    for part in loc:
        is_tag = after_index and part in ROLES
        after_index = isinstance(part, int)
        if after_index:
            path += f"[{part}]"
        elif is_tag or _TYPE_TAG.search(part):
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


# errors our models raise on purpose: more to the point than a union member's type mismatch
_SPECIFIC = ("extra_forbidden", "value_error")


def _param_and_message(error: dict) -> tuple[str | None, str]:
    param = field_path(error["loc"]) or None
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):  # the tag's own field
        field = error["ctx"]["discriminator"].strip("'")
        param = f"{param}.{field}" if param else field
        expected = error["ctx"].get("expected_tags")
        return param, f"must be one of {expected}" if expected else "Field required"
    form = _FORMS.get(re.sub(r"\[.*", "", (param or "").rsplit(".", 1)[-1]))
    union = any(isinstance(p, str) and _TYPE_TAG.search(p) for p in error["loc"])
    ours = error["type"] in _SPECIFIC
    message = f"must be {form}" if form and union and not ours else error["msg"]
    return param, message.removeprefix("Value error, ")


def validation_error(e: ValidationError) -> APIError:
    """A 400 naming the field that failed, in the client's words (the first unknown key or check
    of ours that failed, else the first error). A key that no field of its object takes is an
    unsupported parameter, named with where it is (messages[1].foo)."""
    errors = e.errors()
    error = next((err for err in errors if err["type"] in _SPECIFIC), errors[0])
    param, message = _param_and_message(error)
    if error["type"] == "extra_forbidden":
        return APIError(
            400, f"unsupported parameter {param!r}", param=param, code="unsupported_parameter"
        )
    return APIError(
        400, f"{param}: {message}" if param else message, param=param, code="invalid_value"
    )
