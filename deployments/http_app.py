"""The FastAPI app the ingress's routes hang on (deployments/server.py), and what every request
meets before its route's own work: OpenAI-style error bodies for every failure, a request id, a
count per endpoint and status, the API key check and the body size limit; and the OpenAPI schemas
of the request bodies, which the routes parse themselves."""

import hmac
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api_errors import APIError
from deployments.metrics import ingress_metrics
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

api = FastAPI(title="eagleserve")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


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


@api.exception_handler(APIError)
async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    """An unknown path (404) or method (405): an OpenAI-style body too."""
    return JSONResponse(
        APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code, headers=e.headers
    )


@api.middleware("http")
async def _request_id(request: Request, call_next):
    # Serve's proxy takes x-request-id from the client (or makes one), passes it on and echoes it
    # in the response; we reuse it so our log lines for the request carry it.
    request.state.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    response = await call_next(request)
    if request.url.path in ENDPOINTS:  # every status, errors too (a stream's is 200 once it starts)
        ingress_metrics().count(ENDPOINTS[request.url.path], response.status_code)
    return response


def authorize(request: Request, key: str | None) -> None:
    """With an API key set, the request must carry it as Authorization: Bearer KEY."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if key and not (
        scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
    ):
        raise APIError(
            401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) by its declared length before reading, or once a chunked one grows
    past `limit` bytes."""
    too_large = APIError(413, f"request body over {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)
