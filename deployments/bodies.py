"""The response bodies of the two generation endpoints, whole and as stream chunks, in OpenAI's
published schema (tests/openai_schema)."""

from deployments.choices import Choice
from deployments.logprobs import LogprobFormatter, TextOffsets
from deployments.protocol import completion_id, now


class _Bodies:
    prefix, object, chunk_object = "", "", ""

    def __init__(self, model: str, formatter: LogprobFormatter):
        self.model, self.formatter = model, formatter
        self.id, self.created = completion_id(self.prefix), now()

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage_chunk(self, usage: dict) -> dict:
        return self._head(self.chunk_object) | {"choices": [], "usage": usage}

    def full(self, choices: list[Choice], usage: dict) -> dict:
        return self._head(self.object) | {
            "choices": [self._choice(c) for c in choices],
            "usage": usage,
        }


class ChatBodies(_Bodies):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, formatter: LogprobFormatter):
        super().__init__(model, formatter)
        self.sent_role = set()  # choices whose first chunk went out

    def _choice(self, c: Choice) -> dict:
        wanted = c.params.logprobs is not None
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.text), "refusal": None},
            "finish_reason": c.finish,
            "logprobs": self.formatter.chat(c.logprobs if wanted else None),
        }

    def chunk(self, c: Choice, text: str, finish: str | None, logprobs: list | None) -> dict:
        delta = {"content": text} if text else {}
        if c.index not in self.sent_role:
            delta["role"] = "assistant"
            self.sent_role.add(c.index)
        choice = {
            "index": c.index,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": self.formatter.chat(logprobs),
        }
        return self._head(self.chunk_object) | {"choices": [choice]}


class CompletionBodies(_Bodies):
    """A choice's text starts with its prompt's with echo (in the first chunk of a stream)."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, formatter: LogprobFormatter, echo: dict[int, tuple[str, int]]):
        """echo: per choice index, its prompt's text and length in tokens (empty without echo)."""
        super().__init__(model, formatter)
        self.echo = dict(echo)  # those whose prompt has not been sent yet
        self.offsets = {}

    def _text(self, c: Choice, text: str) -> str:
        prompt, _ = self.echo.pop(c.index, ("", 0))
        return prompt + text

    def _logprobs(self, c: Choice, logprobs: list | None) -> dict | None:
        if c.index not in self.offsets:
            self.offsets[c.index] = TextOffsets(self.echo.get(c.index, ("", 0))[1])
        return self.formatter.completion(logprobs, self.offsets[c.index])

    def _body(self, c: Choice, text: str, finish: str | None, logprobs: list | None) -> dict:
        logprobs = self._logprobs(c, logprobs)  # before _text: it reads the echo
        return {
            "index": c.index,
            "text": self._text(c, text),
            "finish_reason": finish,
            "logprobs": logprobs,
        }

    def _choice(self, c: Choice) -> dict:
        wanted = c.params.logprobs is not None
        return self._body(c, "".join(c.text), c.finish, c.logprobs if wanted else None)

    def chunk(self, c: Choice, text: str, finish: str | None, logprobs: list | None) -> dict:
        return self._head(self.chunk_object) | {"choices": [self._body(c, text, finish, logprobs)]}
