"""A request's choices on the LLM server deployment: each a request of its own, resumed elsewhere
if its replica fails, merged into one reply or one stream (of deployments/bodies.py's bodies)."""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from ray.serve.exceptions import RequestCancelledError

from deployments.api_errors import APIError
from deployments.protocol import usage
from speculative.config import SamplingParams
from speculative.engine.request import RequestOutput

log = logging.getLogger("eagleserve.server")


@dataclass
class Choice:
    index: int  # prompt i's choice j is i * n + j, as in OpenAI's API
    prompt_ids: list[int]
    params: SamplingParams
    is_prompt_only: bool = False  # max_tokens 0: the prompt's log-probabilities, no output
    stream: object = None  # the Serve response in progress, to cancel
    tokens: int = 0  # output tokens so far
    finish: str | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def token_logprobs(self, item: RequestOutput) -> list | None:
        """[(token id, (log-probability, top [(id, log-probability)]))] of the item's tokens, an
        echoed prompt's first (its first token's pair is None); None when not asked for."""
        if self.params.logprobs is None:
            return None
        prompt = []
        if item.prompt_logprobs is not None:
            ids = self.prompt_ids
            prompt = [(ids[0], None)] + list(zip(ids[1:], item.prompt_logprobs))
        return prompt + list(zip(item.new_token_ids, item.logprobs or []))


def seeded_apart(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of a prompt: a seeded request's choices are seeded apart (as vLLM does)."""
    if j == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": (params.seed + j) % 2**63})


def resumable(e: Exception) -> bool:
    """The replica died, was unreachable or its engine failed (503): the request may go elsewhere.
    Not when we cancelled it (the client went away): resuming would leave a request nobody reads."""
    if isinstance(e, RequestCancelledError):
        return False
    err = e if isinstance(e, APIError) else getattr(e, "cause", None)
    return err.status == 503 if isinstance(err, APIError) else True


def as_api_error(e: Exception) -> APIError:
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


async def merged(streams: list):
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


def _resumed(params: SamplingParams, sent: list[int], shown: str, prompt_sent: bool):
    """A resumed request's parameters: its prompt holds the sent tokens, which count for penalties
    and its text; prompt log-probabilities (echo) go out once."""
    update = {
        "max_tokens": params.max_tokens - len(sent),
        "min_tokens": max(0, params.min_tokens - len(sent)),
        "prior_output_tokens": len(sent),
        "prior_text_sent": len(shown),
    }
    if prompt_sent:
        update["prompt_logprobs"] = None
    return params.model_copy(update=update)


async def generate(ingress, rid: str, choice: Choice):
    """The choice's deltas. If its replica dies or its engine fails, the request is resubmitted
    (any healthy replica) as prompt + the tokens already sent, for the remaining max_tokens: the
    client sees a slower stream, not an error, and greedy output is unchanged. The new engine's
    text goes on from the sent tokens' (stop strings spanning the two are found), from what the
    client has of it."""
    sent: list[int] = []
    shown, deadline, attempt, prompt_sent = "", None, 0, False
    while True:
        if len(sent) >= choice.params.max_tokens:
            # no stop string is complete in what was sent; the failed engine held back the rest
            text = ingress.tokenizer.decode(sent, skip_special_tokens=True)
            yield RequestOutput(rid, [], text[len(shown) :], "length")
            return
        choice.stream = ingress.server.generate.remote(
            f"{rid}.{attempt}" if attempt else rid,
            choice.prompt_ids + sent,
            _resumed(choice.params, sent, shown, prompt_sent),
        )
        try:
            async for item in choice.stream:
                sent += item.new_token_ids
                shown += item.text_delta
                prompt_sent = prompt_sent or item.prompt_logprobs is not None
                yield item
                if item.finish_reason:  # ended: nothing to resume, whatever happens next
                    return
            return
        except Exception as e:
            deadline = deadline or time.monotonic() + ingress.cfg.resume_timeout_s
            if not resumable(e) or time.monotonic() >= deadline:
                raise
            log.warning("request %s: resuming after %d tokens (%s)", rid, len(sent), repr(e))
        attempt += 1
        # until Serve notices the failure it may route to the failed replica again
        await asyncio.sleep(min(0.25 * 2**attempt, 2.0))


def _prompt_only(item: RequestOutput) -> RequestOutput:
    """The item without its output (max_tokens 0): the engine generated one token to get there."""
    return RequestOutput(
        item.request_id, [], "", item.finish_reason and "length", 1.0, None, item.prompt_logprobs
    )


class ChoiceRun:
    """One request's choices, run at once. Errors before admission (overload, bad input, no
    replica) become the HTTP status: `admit` waits for every choice's first output, which says its
    replica admitted it."""

    def __init__(self, ingress, request_id: str, choices: list[Choice], prompt_tokens: int):
        rid = f"{request_id}/{uuid.uuid4().hex[:8]}"
        single = len(choices) == 1
        self.ingress, self.choices, self.prompt_tokens = ingress, choices, prompt_tokens
        self.outputs = [
            generate(ingress, rid if single else f"{rid}-{c.index}", c) for c in choices
        ]
        self.firsts = []

    def cancel(self) -> None:
        for c in self.choices:
            if c.stream is not None:
                c.stream.cancel()

    async def admit(self) -> None:
        async def first(output):
            try:
                return await output.__anext__()
            except StopAsyncIteration:
                return None

        firsts = await asyncio.gather(*(first(o) for o in self.outputs), return_exceptions=True)
        if errors := [e for e in firsts if isinstance(e, BaseException)]:
            self.cancel()
            raise as_api_error(errors[0]) from None
        self.firsts = firsts

    async def _choice_items(self, i: int):
        if self.firsts[i] is not None:
            yield self.firsts[i]
        async for item in self.outputs[i]:
            yield item

    async def items(self):
        """(choice, item) as they come; the requests are cancelled when this closes (the client
        went away) and a failure is an OpenAI-style error."""
        stream = merged([self._choice_items(i) for i in range(len(self.choices))])
        try:
            async for i, item in stream:
                choice = self.choices[i]
                item = _prompt_only(item) if choice.is_prompt_only else item
                self._observe(choice, item)
                yield choice, item
        except Exception as e:
            raise as_api_error(e) from None
        finally:
            await stream.aclose()
            self.cancel()

    def _observe(self, choice: Choice, item: RequestOutput) -> None:
        choice.tokens += len(item.new_token_ids)
        choice.finish = item.finish_reason or choice.finish

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(c.tokens for c in self.choices))

    async def reply(self, bodies) -> dict:
        async with contextlib.aclosing(self.items()) as items:
            async for choice, item in items:
                choice.text.append(item.text_delta)
                choice.logprobs += choice.token_logprobs(item) or []
        return bodies.full(self.choices, self.usage())

    async def sse(self, bodies, include_usage: bool, continuous_usage: bool = False):
        """continuous_usage (vLLM's continuous_usage_stats): every chunk has the usage so far."""
        try:
            async with contextlib.aclosing(self.items()) as items:  # closed if the client goes
                async for choice, item in items:
                    logprobs = choice.token_logprobs(item)
                    if not (item.text_delta or item.finish_reason or logprobs):
                        continue
                    for chunk in bodies.chunks(
                        choice, item.text_delta, item.finish_reason, logprobs
                    ):
                        if include_usage:  # OpenAI: every chunk has the field, null until the last
                            chunk["usage"] = self.usage() if continuous_usage else None
                        yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                yield f"data: {json.dumps(bodies.usage_chunk(self.usage()))}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as e:  # the stream already started: report in-band, OpenAI style
            yield f"data: {json.dumps(as_api_error(e).body())}\n\n"
