"""The Ray Serve application: the OpenAI-compatible FastAPI ingress in front of the LLM server
deployment (deployments/llm_server.py)."""
import asyncio
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

from deployments.config import ServeConfig
from deployments.llm_server import LLMServer, llm_server_options
from deployments.metrics import ingress_metrics
from deployments.protocol import (APIError, ChatCompletionRequest, CompletionRequest, completion_id, json_body, now,
                                  parse_json_object, refuse_unknown, request_schemas, usage)
from speculative.config import SamplingParams
from speculative.scheduler import RequestOutput

log = logging.getLogger("eagleserve.server")
api = FastAPI(title="eagleserve")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def _openapi() -> dict:
    """FastAPI's schema plus the request bodies, which the routes parse themselves (the size limit
    comes before reading, errors are OpenAI's): clients and fuzzers see the real request schemas."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi


@api.exception_handler(APIError)
async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    """An unknown path (404) or method (405): an OpenAI-style body too."""
    return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code, headers=e.headers)


@api.middleware("http")
async def _request_id(request: Request, call_next):
    # Serve's proxy takes x-request-id from the client (or makes one), passes it on and echoes it
    # in the response; we reuse it so our log lines for the request carry it.
    request.state.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    response = await call_next(request)
    if request.url.path in ENDPOINTS:  # every status, errors too (a stream's is 200 once it starts)
        ingress_metrics().requests[(ENDPOINTS[request.url.path], response.status_code)] += 1
    return response


def _resumable(e: Exception) -> bool:
    """The replica died, was unreachable or its engine failed (503): the request may go elsewhere."""
    err = e if isinstance(e, APIError) else getattr(e, "cause", None)
    return err.status == 503 if isinstance(err, APIError) else True


def _as_api_error(e: Exception) -> APIError:
    cause = getattr(e, "cause", None)
    if isinstance(e, APIError):
        return e
    if isinstance(cause, APIError):
        return cause
    return APIError(503, f"the server could not complete the request: {type(e).__name__}", "server_error",
                    headers={"Retry-After": "5"})


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, server, cfg: ServeConfig):
        from workers.llama import LlamaConfig
        from workers.loader import load_config, load_tokenizer, resolve_model
        self.cfg = cfg
        self.server = server.options(stream=True)
        self.stats_handle = server
        model_dir = resolve_model(cfg.engine.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.max_model_len = LlamaConfig.from_hf(load_config(model_dir)).max_len(cfg.engine.max_model_len)
        self.metrics = ingress_metrics()

    def _authorize(self, request: Request) -> None:
        key = self.cfg.resolved_api_key
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if key and not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())):
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) by its declared length before reading, or once a chunked one
        grows past the limit."""
        limit = self.cfg.max_request_bytes
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

    async def _parse(self, request: Request, model_cls):
        self._authorize(request)
        data = parse_json_object(await self._read_body(request))
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param,
                           code="invalid_value") from None
        refuse_unknown(req)
        if req.model != self.cfg.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def _sampling(self, req, prompt_ids: list[int], max_tokens: int | None, prompt_param: str) -> SamplingParams:
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; the maximum context is {limit}",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"maximum context of {limit} tokens", param="max_tokens", code="context_length_exceeded")
        return req.sampling_params(limit - len(prompt_ids)).model_copy(
            update={"max_tokens": max_tokens or limit - len(prompt_ids)})

    async def _generate(self, rid: str, prompt_ids: list[int], params: SamplingParams, current: list):
        """The request's deltas. If its replica dies or its engine fails, the request is resubmitted
        (any healthy replica) as prompt + the tokens already sent, for the remaining max_tokens: the
        client sees a slower stream, not an error, and greedy output is unchanged. A stop string
        that spans the resume point is not found. `current[0]` is the stream in progress (to cancel)."""
        sent: list[int] = []
        shown, deadline, attempt = "", None, 0
        while True:
            left = params.max_tokens - len(sent)
            if left <= 0:
                yield RequestOutput(rid, [], "", "length")
                return
            current[0] = self.server.generate.remote(f"{rid}.{attempt}" if attempt else rid, prompt_ids + sent,
                                                     params.model_copy(update={"max_tokens": left}))
            try:
                async for item in current[0]:
                    sent += item.new_token_ids
                    shown += item.text_delta
                    yield item
                return
            except Exception as e:
                deadline = deadline or time.monotonic() + self.cfg.resume_timeout_s
                if not _resumable(e) or time.monotonic() >= deadline:
                    raise
                log.warning("request %s: resuming after %d tokens (%s)", rid, len(sent), type(e).__name__)
            # the failed engine may have held back text that could have begun a stop string, and the
            # new request's text starts after these tokens: send it now
            text = self.tokenizer.decode(sent, skip_special_tokens=True)
            if text.startswith(shown) and len(text) > len(shown):
                yield RequestOutput(rid, [], text[len(shown):], None)
                shown = text
            attempt += 1
            # until Serve notices the failure it may route to the failed replica again
            await asyncio.sleep(min(0.25 * 2 ** attempt, 2.0))

    async def _run(self, request: Request, prompt_ids, params, stream: bool, make_chunk, make_full,
                   include_usage: bool):
        rid = f"{request.state.request_id}/{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        current = [None]
        outputs = self._generate(rid, prompt_ids, params, current)
        try:
            first = await outputs.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:
            raise _as_api_error(e) from None
        self.metrics.prompt_tokens += len(prompt_ids)
        state = {"tokens": 0, "last": start, "finish": None}

        async def deltas():
            if first is not None:
                yield first
            try:
                async for item in outputs:
                    yield item
            except Exception as e:  # a non-streamed reply then fails with an OpenAI-style error too
                raise _as_api_error(e) from None

        def observe(item):
            t = time.perf_counter()
            if item.new_token_ids:
                if state["tokens"] == 0:
                    self.metrics.ttft.observe(t - start)
                else:
                    self.metrics.itl.observe((t - state["last"]) / len(item.new_token_ids))
                state["last"] = t
            state["tokens"] += len(item.new_token_ids)
            self.metrics.completion_tokens += len(item.new_token_ids)
            state["finish"] = item.finish_reason or state["finish"]

        if not stream:
            text = []
            async for item in deltas():
                observe(item)
                text.append(item.text_delta)
            return make_full("".join(text), state["finish"], usage(len(prompt_ids), state["tokens"]))

        async def sse():
            try:
                async for item in deltas():
                    observe(item)
                    if item.text_delta or item.finish_reason:
                        chunk = make_chunk(item.text_delta, item.finish_reason)
                        if include_usage:  # OpenAI: every chunk has the field, null until the last
                            chunk["usage"] = None
                        yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage:
                    yield f"data: {json.dumps(make_chunk(None, None, usage(len(prompt_ids), state['tokens'])))}\n\n"
                yield "data: [DONE]\n\n"
            except Exception as e:  # the stream already started: report in-band, OpenAI style
                yield f"data: {json.dumps(_as_api_error(e).body())}\n\n"
            finally:
                current[0].cancel()
        return StreamingResponse(sse(), media_type="text/event-stream")

    @api.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        from speculative.engine import encode_prompt
        prompt_ids = encode_prompt(self.tokenizer, [{"role": m.role if m.role != "developer" else "system",
                                                     "content": m.text()} for m in req.messages])
        params = self._sampling(req, prompt_ids, req.max_completion_tokens or req.max_tokens, "messages")
        cid, created = completion_id("chatcmpl"), now()
        sent_role = []

        def chunk(text, finish, usage_=None):
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model_name,
                    "choices": []}
            if usage_ is not None:
                body["usage"] = usage_
                return body
            delta = {"content": text} if text else {}
            if not sent_role:
                delta["role"] = "assistant"
                sent_role.append(True)
            body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
            return body

        def full(text, finish, usage_):
            return {"id": cid, "object": "chat.completion", "created": created, "model": self.cfg.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish, "logprobs": None}], "usage": usage_}
        include = bool(req.stream_options and req.stream_options.include_usage)
        return await self._run(request, prompt_ids, params, req.stream, chunk, full, include)

    @api.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            prompt_ids = self.tokenizer.encode(req.prompt, add_special_tokens=False)
        else:
            prompt_ids = req.prompt
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise APIError(400, f"prompt token ids must lie in 0..{vocab - 1}", param="prompt", code="invalid_value")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        params = self._sampling(req, prompt_ids, req.max_tokens, "prompt")
        cid, created = completion_id("cmpl"), now()

        def chunk(text, finish, usage_=None):
            body = {"id": cid, "object": "text_completion", "created": created, "model": self.cfg.model_name,
                    "choices": [] if usage_ else [{"index": 0, "text": text or "", "finish_reason": finish,
                                                   "logprobs": None}]}
            if usage_:
                body["usage"] = usage_
            return body

        def full(text, finish, usage_):
            return {"id": cid, "object": "text_completion", "created": created, "model": self.cfg.model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": usage_}
        include = bool(req.stream_options and req.stream_options.include_usage)
        return await self._run(request, prompt_ids, params, req.stream, chunk, full, include)

    def _model_card(self) -> dict:
        return {"id": self.cfg.model_name, "object": "model", "created": now(), "owned_by": "eagleserve"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        self._authorize(request)
        if model != self.cfg.model_name:
            raise APIError(404, f"model {model!r} does not exist", param="model", code="model_not_found")
        return self._model_card()

    @api.get("/health")
    async def health(self):
        try:  # a replica that does not answer is not healthy either
            stats = await asyncio.wait_for(self.stats_handle.stats.remote(), timeout=5)
        except Exception as e:
            raise APIError(503, f"the engine does not answer: {type(e).__name__}", "server_error") from None
        if not stats["healthy"]:
            raise APIError(503, "the engine is not healthy", "server_error")
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(self.metrics.render(await self.stats_handle.stats.remote()),
                                 media_type="text/plain; version=0.0.4")


def build_app(cfg: ServeConfig | dict):
    """The Serve application. `serve run deployments/serve_config.yaml` calls this with its args."""
    cfg = ServeConfig.model_validate(cfg) if isinstance(cfg, dict) else cfg
    server = LLMServer.options(**llm_server_options(cfg)).bind(cfg)
    return OpenAIIngress.options(ray_actor_options={"num_cpus": 0.01},
                                 max_ongoing_requests=cfg.max_ongoing_requests * cfg.num_replicas).bind(server, cfg)
