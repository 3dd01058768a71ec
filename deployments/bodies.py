"""The response bodies of the two generation endpoints, whole and as stream chunks, in OpenAI's
published schema (tests/openai_schema)."""

from deployments.chat_output import ChatOutput, merged_message
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
    """new_output: a choice's ChatOutput (deployments/chat_output.py: reasoning, tool calls)."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, formatter: LogprobFormatter, new_output=ChatOutput):
        super().__init__(model, formatter)
        self.sent_role = set()  # choices whose first chunk went out
        self.new_output, self.outputs = new_output, {}

    def _output(self, c: Choice) -> ChatOutput:
        if c.index not in self.outputs:
            self.outputs[c.index] = self.new_output()
        return self.outputs[c.index]

    def _finish(self, c: Choice, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and self._output(c).has_tool_calls else finish

    def _choice(self, c: Choice) -> dict:
        wanted = c.params.logprobs is not None
        deltas = self._output(c).feed("".join(c.text), final=True)
        return {
            "index": c.index,
            "message": merged_message(deltas),
            "finish_reason": self._finish(c, c.finish),
            "logprobs": self.formatter.chat(c.logprobs if wanted else None),
        }

    def chunks(self, c: Choice, text: str, finish: str | None, logprobs: list | None) -> list:
        """The chunks of a choice's new text: one per delta, the last with the finish reason and
        the text's log-probabilities; none while the text is held back."""
        deltas = self._output(c).feed(text, final=finish is not None)
        if not deltas and (finish or logprobs):
            deltas = [{}]
        chunks = []
        for i, delta in enumerate(deltas):
            if c.index not in self.sent_role:
                delta = {"role": "assistant"} | delta
                self.sent_role.add(c.index)
            last = i == len(deltas) - 1
            choice = {
                "index": c.index,
                "delta": delta,
                "finish_reason": self._finish(c, finish) if last else None,
                "logprobs": self.formatter.chat(logprobs if last else None),
            }
            chunks.append(self._head(self.chunk_object) | {"choices": [choice]})
        return chunks


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

    def chunks(self, c: Choice, text: str, finish: str | None, logprobs: list | None) -> list:
        body = self._body(c, text, finish, logprobs)
        return [self._head(self.chunk_object) | {"choices": [body]}]
