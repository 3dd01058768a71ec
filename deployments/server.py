"""The Ray Serve application: the OpenAI-compatible FastAPI ingress in front of the LLM server
deployment (deployments/llm_server.py)."""

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import RequestCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import ServeConfig
from deployments.llm_server import LLMServer, llm_server_options
from deployments.logprobs import LogprobFormatter, TextOffsets
from deployments.metrics import ingress_metrics
from deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    completion_id,
    json_body,
    now,
    parse_json_object,
    refuse_unknown,
    request_schemas,
    usage,
)
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
        ingress_metrics().requests[(ENDPOINTS[request.url.path], response.status_code)] += 1
    return response


def _resumable(e: Exception) -> bool:
    """The replica died, was unreachable or its engine failed (503): the request may go elsewhere.
    Not when we cancelled it (the client went away): resuming would leave a request nobody reads."""
    if isinstance(e, RequestCancelledError):
        return False
    err = e if isinstance(e, APIError) else getattr(e, "cause", None)
    return err.status == 503 if isinstance(err, APIError) else True


def _as_api_error(e: Exception) -> APIError:
    cause = getattr(e, "cause", None)
    if isinstance(e, APIError):
        return e
    if isinstance(cause, APIError):
        return cause
    return APIError(
        503,
        f"the server could not complete the request: {type(e).__name__}",
        "server_error",
        headers={"Retry-After": "5"},
    )


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a request: a seeded request's choices are seeded apart (as vLLM does)."""
    if index == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": (params.seed + index) % 2**63})


async def _merged(streams: list):
    """(index, item) from several async iterators, each's items in order, as they arrive."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, server, cfg: ServeConfig):
        from workers.loader import load_tokenizer, resolve_model
        from workers.models import ModelConfig, load_config

        self.cfg = cfg
        self.server = server.options(stream=True)
        self.stats_handle = server
        model_dir = resolve_model(cfg.engine.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.capacity = None  # requests a replica takes at once, read from one on the first n > 1
        self.max_model_len = ModelConfig.from_hf(load_config(model_dir)).max_len(
            cfg.engine.max_model_len
        )
        self.metrics = ingress_metrics()

    def _authorize(self, request: Request) -> None:
        key = self.cfg.resolved_api_key
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if key and not (
            scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
        ):
            raise APIError(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )

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
            raise APIError(
                400,
                f"{param}: {err['msg']}" if param else err["msg"],
                param=param,
                code="invalid_value",
            ) from None
        if isinstance(req, (ChatCompletionRequest, CompletionRequest)):
            refuse_unknown(req)
        if req.model != self.cfg.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if getattr(req, "n", 1) > 1:
            if (
                self.capacity is None
            ):  # the slots a replica has (memory_budget_gb may allow fewer than max_batch_size)
                self.capacity = (await self.stats_handle.stats.remote())[
                    "num_slots"
                ] + self.cfg.max_waiting_requests
            if req.n > self.capacity:
                raise APIError(
                    400,
                    f"n is {req.n}; a replica of this server takes at most {self.capacity} requests "
                    "at once",
                    param="n",
                    code="invalid_value",
                )
        return req

    def _sampling(
        self, req, prompt_ids: list[int], max_tokens: int | None, prompt_param: str
    ) -> SamplingParams:
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; the maximum context is {limit}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
            raise APIError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"maximum context of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = max_tokens or limit - len(prompt_ids)
        if req.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                param="min_tokens",
                code="invalid_value",
            )
        return req.sampling_params(max_tokens)

    async def _generate(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, current: list
    ):
        """The request's deltas. If its replica dies or its engine fails, the request is resubmitted
        (any healthy replica) as prompt + the tokens already sent, for the remaining max_tokens: the
        client sees a slower stream, not an error, and greedy output is unchanged. The new engine's
        text goes on from the sent tokens' (stop strings spanning the two are found), from what the
        client has of it. `current[0]` is the stream in progress (to cancel)."""
        sent: list[int] = []
        shown, deadline, attempt, prompt_sent = "", None, 0, False
        while True:
            left = params.max_tokens - len(sent)
            if (
                left <= 0
            ):  # no stop string is complete in what was sent; the failed engine held back the rest
                text = self.tokenizer.decode(sent, skip_special_tokens=True)
                yield RequestOutput(rid, [], text[len(shown) :], "length")
                return
            # a resumed request's prompt holds the sent tokens, which count for penalties and its text;
            # prompt log-probabilities (echo) go out once
            resumed = {
                "max_tokens": left,
                "min_tokens": max(0, params.min_tokens - len(sent)),
                "prior_output_tokens": len(sent),
                "prior_text_sent": len(shown),
            }
            if prompt_sent:
                resumed["prompt_logprobs"] = None
            current[0] = self.server.generate.remote(
                f"{rid}.{attempt}" if attempt else rid,
                prompt_ids + sent,
                params.model_copy(update=resumed),
            )
            try:
                async for item in current[0]:
                    sent += item.new_token_ids
                    shown += item.text_delta
                    prompt_sent = prompt_sent or item.prompt_logprobs is not None
                    yield item
                return
            except Exception as e:
                deadline = deadline or time.monotonic() + self.cfg.resume_timeout_s
                if not _resumable(e) or time.monotonic() >= deadline:
                    raise
                log.warning(
                    "request %s: resuming after %d tokens (%s)", rid, len(sent), type(e).__name__
                )
            attempt += 1
            # until Serve notices the failure it may route to the failed replica again
            await asyncio.sleep(min(0.25 * 2**attempt, 2.0))

    async def _run(
        self,
        request: Request,
        prompt_ids,
        params,
        n: int,
        stream: bool,
        make_chunk,
        make_full,
        include_usage: bool,
    ):
        """Generate n choices (requests of their own; a seeded request's choice i has seed + i) and
        answer with all of them, or stream their chunks as they come. make_chunk(index, text, finish,
        logprobs) and make_full([(text, finish, logprobs)], usage) shape the bodies; logprobs are
        [(token id, (log-probability, top [(id, log-probability)]))], or None when not asked for."""
        rid = f"{request.state.request_id}/{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        currents = [[None] for _ in range(n)]
        outputs = [
            self._generate(
                rid if n == 1 else f"{rid}-{i}", prompt_ids, _choice_params(params, i), currents[i]
            )
            for i in range(n)
        ]

        def cancel_all():
            for current in currents:
                if current[0] is not None:
                    current[0].cancel()

        async def first(output):
            try:
                return await output.__anext__()
            except StopAsyncIteration:
                return None

        # errors before admission (overload, bad input, no replica) become the HTTP status; the
        # replica's first output says the request was admitted
        firsts = await asyncio.gather(*(first(o) for o in outputs), return_exceptions=True)
        if errors := [e for e in firsts if isinstance(e, BaseException)]:
            cancel_all()
            raise _as_api_error(errors[0]) from None
        self.metrics.prompt_tokens += len(prompt_ids)
        states = [{"tokens": 0, "last": start, "finish": None} for _ in range(n)]

        async def choice(i):
            if firsts[i] is not None:
                yield firsts[i]
            async for item in outputs[i]:
                yield item

        async def deltas():
            merged = _merged([choice(i) for i in range(n)])
            try:
                async for i, item in merged:
                    yield i, item
            except Exception as e:  # a non-streamed reply then fails with an OpenAI-style error too
                raise _as_api_error(e) from None
            finally:
                await merged.aclose()
                cancel_all()

        def observe(i, item):
            t, state = time.perf_counter(), states[i]
            if item.new_token_ids:
                if not any(s["tokens"] for s in states):
                    self.metrics.ttft.observe(t - start)
                elif state["tokens"]:
                    self.metrics.itl.observe((t - state["last"]) / len(item.new_token_ids))
                state["last"] = t
            state["tokens"] += len(item.new_token_ids)
            self.metrics.completion_tokens += len(item.new_token_ids)
            state["finish"] = item.finish_reason or state["finish"]

        def total_usage():
            return usage(len(prompt_ids), sum(s["tokens"] for s in states))

        def token_logprobs(item):
            if params.logprobs is None:
                return None
            prompt = []
            if (
                item.prompt_logprobs is not None
            ):  # echo: the prompt's tokens first, the first one without
                prompt = [(prompt_ids[0], None)] + list(zip(prompt_ids[1:], item.prompt_logprobs))
            return prompt + list(zip(item.new_token_ids, item.logprobs or []))

        if not stream:
            texts, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
            async with contextlib.aclosing(deltas()) as items:
                async for i, item in items:
                    observe(i, item)
                    texts[i].append(item.text_delta)
                    logprobs[i] += token_logprobs(item) or []
            return make_full(
                [
                    ("".join(t), s["finish"], lp if params.logprobs is not None else None)
                    for t, s, lp in zip(texts, states, logprobs)
                ],
                total_usage(),
            )

        async def sse():
            try:
                async with contextlib.aclosing(
                    deltas()
                ) as items:  # closed (requests cancelled) if the client goes
                    async for i, item in items:
                        observe(i, item)
                        if (
                            item.text_delta
                            or item.finish_reason
                            or item.new_token_ids
                            and params.logprobs is not None
                        ):
                            chunk = make_chunk(
                                i, item.text_delta, item.finish_reason, token_logprobs(item)
                            )
                            if (
                                include_usage
                            ):  # OpenAI: every chunk has the field, null until the last
                                chunk["usage"] = None
                            yield f"data: {json.dumps(chunk)}\n\n"
                if include_usage:
                    yield f"data: {json.dumps(make_chunk(None, None, None, None, total_usage()))}\n\n"
                yield "data: [DONE]\n\n"
            except Exception as e:  # the stream already started: report in-band, OpenAI style
                yield f"data: {json.dumps(_as_api_error(e).body())}\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    def _chat_ids(self, messages) -> list[int]:
        from speculative.engine import encode_prompt

        return encode_prompt(
            self.tokenizer,
            [
                {"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in messages
            ],
        )

    @api.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        prompt_ids = self._chat_ids(req.messages)
        params = self._sampling(
            req, prompt_ids, req.max_completion_tokens or req.max_tokens, "messages"
        )
        cid, created = completion_id("chatcmpl"), now()
        sent_role = set()  # choices whose first chunk went out

        def chunk(index, text, finish, logprobs, usage_=None):
            body = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.cfg.model_name,
                "choices": [],
            }
            if usage_ is not None:
                body["usage"] = usage_
                return body
            delta = {"content": text} if text else {}
            if index not in sent_role:
                delta["role"] = "assistant"
                sent_role.add(index)
            body["choices"] = [
                {
                    "index": index,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": self.logprobs.chat(logprobs),
                }
            ]
            return body

        def full(choices, usage_):
            return {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": self.cfg.model_name,
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                        "logprobs": self.logprobs.chat(logprobs),
                    }
                    for i, (text, finish, logprobs) in enumerate(choices)
                ],
                "usage": usage_,
            }

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await self._run(request, prompt_ids, params, req.n, req.stream, chunk, full, include)

    @api.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            prompt_ids = self.tokenizer.encode(req.prompt, add_special_tokens=False)
        else:
            prompt_ids = req.prompt
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise APIError(
                    400,
                    f"prompt token ids must lie in 0..{vocab - 1}",
                    param="prompt",
                    code="invalid_value",
                )
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        params = self._sampling(req, prompt_ids, req.max_tokens, "prompt")
        cid, created = completion_id("cmpl"), now()
        offsets = [TextOffsets(len(prompt_ids) if req.echo else 0) for _ in range(req.n)]
        echo = set() if req.echo else set(range(req.n))  # choices whose text has its prompt already
        prompt_text = (
            req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(prompt_ids)
        )

        def text_of(index, text):
            if index in echo:
                return text or ""
            echo.add(index)
            return prompt_text + (text or "")

        def chunk(index, text, finish, logprobs, usage_=None):
            body = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": self.cfg.model_name,
                "choices": []
                if usage_
                else [
                    {
                        "index": index,
                        "text": text_of(index, text),
                        "finish_reason": finish,
                        "logprobs": self.logprobs.completion(logprobs, offsets[index]),
                    }
                ],
            }
            if usage_:
                body["usage"] = usage_
            return body

        def full(choices, usage_):
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": self.cfg.model_name,
                "choices": [
                    {
                        "index": i,
                        "text": text_of(i, text),
                        "finish_reason": finish,
                        "logprobs": self.logprobs.completion(logprobs, offsets[i]),
                    }
                    for i, (text, finish, logprobs) in enumerate(choices)
                ],
                "usage": usage_,
            }

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await self._run(request, prompt_ids, params, req.n, req.stream, chunk, full, include)

    @api.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize(self, request: Request):
        req = await self._parse(request, TokenizeRequest)
        ids = (
            self._chat_ids(req.messages)
            if req.messages is not None
            else self.tokenizer.encode(req.prompt, add_special_tokens=False)
        )
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    @api.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(self, request: Request):
        req = await self._parse(request, DetokenizeRequest)
        if any(not 0 <= t < len(self.tokenizer) for t in req.tokens):
            raise APIError(
                400,
                f"token ids must lie in 0..{len(self.tokenizer) - 1}",
                param="tokens",
                code="invalid_value",
            )
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def _model_card(self) -> dict:
        return {
            "id": self.cfg.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "eagleserve",
        }

    @api.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        self._authorize(request)
        if model != self.cfg.model_name:
            raise APIError(
                404, f"model {model!r} does not exist", param="model", code="model_not_found"
            )
        return self._model_card()

    @api.get("/health")
    async def health(self):
        try:  # a replica that does not answer is not healthy either
            stats = await asyncio.wait_for(self.stats_handle.stats.remote(), timeout=5)
        except Exception as e:
            raise APIError(
                503, f"the engine does not answer: {type(e).__name__}", "server_error"
            ) from None
        if not stats["healthy"]:
            raise APIError(503, "the engine is not healthy", "server_error")
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(
            self.metrics.render(await self.stats_handle.stats.remote()),
            media_type="text/plain; version=0.0.4",
        )


def build_app(cfg: ServeConfig | dict):
    """The Serve application. `serve run deployments/serve_config.yaml` calls this with its args."""
    cfg = ServeConfig.model_validate(cfg) if isinstance(cfg, dict) else cfg
    server = LLMServer.options(**llm_server_options(cfg)).bind(cfg)
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": 0.01},
        max_ongoing_requests=cfg.max_ongoing_requests * cfg.num_replicas,
    ).bind(server, cfg)
