"""The Ray Serve application: the OpenAI-compatible FastAPI ingress (its routes; the app they hang
on is deployments/http_app.py) in front of the LLM server deployment (deployments/llm_server.py)."""

import asyncio
import logging

from fastapi import Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from deployments.api_errors import APIError, parse_json_object, validation_error
from deployments.bodies import ChatBodies, CompletionBodies
from deployments.chat_output import chat_params, output_maker, starts_in_reasoning
from deployments.chat_template import ChatTemplate
from deployments.choices import Choice, ChoiceRun, seeded_apart
from deployments.config import ServeConfig
from deployments.generation_config import generation_defaults
from deployments.http_app import api, authorize, json_body, read_body, request_schemas
from deployments.llm_server import LLMServer, llm_server_options
from deployments.logprobs import LogprobFormatter
from deployments.metrics import CONTENT_TYPE, exposition, ingress_metrics
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
    refuse_unknown,
)
from deployments.replicas import registry
from deployments.tools import forced_tool_call_schema, parser_for_template

log = logging.getLogger("eagleserve.server")


def _openapi() -> dict:
    """FastAPI's schema plus the request bodies, which the routes parse themselves (the size limit
    comes before reading, errors are OpenAI's): clients and fuzzers see the real request schemas.
    Here, not in http_app.py: a replica finds this function by importing this module, which is what
    puts the routes below on `api` in that process."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, server, cfg: ServeConfig):
        from workers.models import ModelConfig, load_config
        from workers.models.loader import load_tokenizer, resolve_model

        self.cfg = cfg
        self.server = server.options(stream=True)
        self.stats_handle = server
        model_dir = resolve_model(cfg.engine.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.template = ChatTemplate(self.tokenizer, cfg.chat_template)
        self.tool_call_parser = cfg.tool_call_parser or parser_for_template(
            self.template.source or ""
        )
        self.capacity = None  # requests a replica takes at once, read from one on the first n > 1
        self.max_model_len = ModelConfig.from_hf(load_config(model_dir)).max_len(
            cfg.engine.max_model_len
        )
        self.sampling_defaults = generation_defaults(cfg.generation_config, model_dir)
        self.metrics = ingress_metrics()
        self.registry = registry(serve.get_replica_context().app_name)

    async def _parse(self, request: Request, model_cls):
        authorize(request, self.cfg.resolved_api_key)
        data = parse_json_object(await read_body(request, self.cfg.max_request_bytes))
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if isinstance(req, (ChatCompletionRequest, CompletionRequest)):
            refuse_unknown(req)
        if req.model != self.cfg.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if isinstance(req, (ChatCompletionRequest, CompletionRequest)):
            req.check_priority(self.cfg.engine.scheduling_policy)
            await self._check_capacity(req)
        return req

    async def _check_capacity(self, req) -> None:
        """A request's choices must fit a replica at once (they wait for each other's admission)."""
        if (n := req.num_choices()) == 1:
            return
        if self.capacity is None:  # memory_budget_gb may allow fewer slots than max_batch_size
            stats = await self.stats_handle.stats.remote()
            self.capacity = stats["num_slots"] + self.cfg.max_waiting_requests
        if n > self.capacity:
            param = "n" if n == req.n else "prompt"
            raise APIError(
                400,
                f"the request has {n} choices (n times the prompts); a replica of this server "
                f"takes at most {self.capacity} requests at once",
                param=param,
                code="invalid_value",
            )

    def _sampling(self, req, prompt_ids: list[int], max_tokens: int | None, param: str):
        """The engine's parameters for one prompt. max_tokens 0 (completions: the prompt's
        log-probabilities only) runs one token, which the reply leaves out."""
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; the maximum context is {limit}",
                param=param,
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
        default = self.sampling_defaults.get("max_tokens", limit)  # the model's max_new_tokens
        max_tokens = min(limit - len(prompt_ids), default) if max_tokens is None else max_tokens
        if req.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                param="min_tokens",
                code="invalid_value",
            )
        return req.sampling_params(max(1, max_tokens), self.sampling_defaults)

    def _choices(self, req, prompts: list[list[int]], max_tokens, param: str) -> list[Choice]:
        """Each prompt's n choices (requests of their own; a seeded request's choice j has seed
        + j), indexed as OpenAI does."""
        choices = []
        for i, ids in enumerate(prompts):
            params = self._sampling(
                req, ids, max_tokens, param if len(prompts) == 1 else f"{param}[{i}]"
            )
            choices += [
                Choice(i * req.n + j, ids, seeded_apart(params, j), is_prompt_only=max_tokens == 0)
                for j in range(req.n)
            ]
        return choices

    async def _run(self, request: Request, req, choices: list[Choice], prompt_tokens: int, bodies):
        """Answer with all the choices, or stream their chunks as they come."""
        run = ChoiceRun(self, request.state.request_id, choices, prompt_tokens)
        await run.admit()
        if not req.stream:
            return await run.reply(bodies)
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and options.continuous_usage_stats
        return StreamingResponse(
            run.sse(bodies, include_usage, continuous), media_type="text/event-stream"
        )

    @api.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat(self, request: Request):
        req = await self._parse(request, ChatCompletionRequest)
        tools = req.tool_dicts()
        schema = forced_tool_call_schema(tools, req.tool_choice_value(), req.parallel_tool_calls)
        ids, prompt_text = self.template.encode(req, tools)
        choices = self._choices(req, [ids], req.max_completion_tokens or req.max_tokens, "messages")
        thinking = starts_in_reasoning(prompt_text, self.cfg.reasoning_parser)
        for c in choices:  # a forced call's grammar; a grammar waits for the reasoning's end
            c.params = chat_params(c.params, schema, thinking)
        reading = (self.tool_call_parser, self.cfg.reasoning_parser)
        bodies = ChatBodies(
            self.cfg.model_name, self.logprobs, output_maker(req, prompt_text, *reading)
        )
        return await self._run(request, req, choices, len(ids), bodies)

    def _prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids, vocab = prompt, len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(
                    400,
                    f"prompt token ids must lie in 0..{vocab - 1}",
                    param=param,
                    code="invalid_value",
                )
        if not ids:
            raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
        return ids

    @api.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(self, request: Request):
        req = await self._parse(request, CompletionRequest)
        several = len(req.prompt) > 1
        prompts = [
            self._prompt_ids(p, f"prompt[{i}]" if several else "prompt")
            for i, p in enumerate(req.prompt)
        ]
        choices = self._choices(req, prompts, req.max_tokens, "prompt")
        echo = {}
        if req.echo:  # each choice's text starts with its prompt's, as it was given
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in req.prompt]
            echo = {c.index: (texts[c.index // req.n], len(c.prompt_ids)) for c in choices}
        bodies = CompletionBodies(self.cfg.model_name, self.logprobs, echo)
        return await self._run(request, req, choices, sum(map(len, prompts)), bodies)

    @api.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize(self, request: Request):
        req = await self._parse(request, TokenizeRequest)
        ids = (
            self.template.encode(req, req.tool_dicts())[0]
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
        authorize(request, self.cfg.resolved_api_key)
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        authorize(request, self.cfg.resolved_api_key)
        if model != self.cfg.model_name:
            raise APIError(
                404, f"model {model!r} does not exist", param="model", code="model_not_found"
            )
        return self._model_card()

    async def _replicas(self) -> dict[str, dict]:
        """Every live replica's stats (deployments/replicas.py), the one the handle reaches fresh;
        a 503 when that one does not answer."""
        try:
            fresh = await asyncio.wait_for(self.stats_handle.stats.remote(), timeout=5)
            reported = await asyncio.wait_for(self.registry.live.remote(), timeout=5)
        except Exception as e:
            raise APIError(
                503, f"the engine does not answer: {type(e).__name__}", "server_error"
            ) from None
        return reported | {fresh["replica"]: fresh}

    @api.get("/health")
    async def health(self):
        """Healthy when every replica is."""
        replicas = await self._replicas()
        if sick := sorted(r for r, s in replicas.items() if not s["healthy"]):
            raise APIError(503, f"replicas not healthy: {', '.join(sick)}", "server_error")
        return {"status": "ok", "replicas": {r: "ok" for r in sorted(replicas)}}

    @api.get("/metrics")
    async def metrics(self):
        """Every replica's series, labelled by replica (a dashboard sums them)."""
        body = exposition(self.metrics, self.cfg.model_name, await self._replicas())
        return Response(body, media_type=CONTENT_TYPE)


def build_app(cfg: ServeConfig | dict):
    """The Serve application. `serve run deployments/serve_config.yaml` calls this with its args."""
    cfg = ServeConfig.model_validate(cfg) if isinstance(cfg, dict) else cfg
    server = LLMServer.options(**llm_server_options(cfg)).bind(cfg)
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": 0.01},
        max_ongoing_requests=cfg.max_ongoing_requests * cfg.num_replicas,
    ).bind(server, cfg)
