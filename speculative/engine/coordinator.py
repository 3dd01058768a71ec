"""The coordinator: the decode loop that drives the tensor-parallel group (`executor.py`).
`Coordinator` runs the overlapped loop of `LLMEngine` over a `RayExecutor` in a thread and streams
each request's tokens as they are accepted; `CoordinatorActor` is the same as a Ray actor."""

import asyncio
import logging
import queue
import threading
import time
import uuid

import ray

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.executor import EngineDeadError, RayExecutor
from speculative.engine.llm_engine import LLMEngine
from speculative.engine.request import RequestError

log = logging.getLogger(__name__)


class Coordinator:
    """Runs the decode loop in a thread; callers add requests and read their token streams
    (a queue.Queue, or an asyncio.Queue with its event loop, receiving RequestOutput deltas, then
    None at the end or an exception if the group failed)."""

    def __init__(self, cfg: EngineConfig, **executor_kwargs):
        self.cfg = cfg
        self.executor = RayExecutor(cfg, **executor_kwargs)
        self.engine = LLMEngine(cfg, self.executor)
        self.tokenizer = self.engine.tokenizer
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop | None, object]] = {}
        self.streams_lock = threading.Lock()  # add() registers from callers' threads
        self.error: str | None = None
        self.wait_s = 0.0  # loop time spent blocked on workers
        self.busy_s = 0.0  # loop time with work to do
        self.step_started: float | None = None  # monotonic start of the engine step in progress
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="coordinator-loop", daemon=True)
        self.thread.start()

    # ---- called from other threads ----

    def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink=None, loop=None
    ) -> None:
        """Validate now (errors raise here), then enqueue for the loop thread."""
        if self.error or self.stopped.is_set():
            raise EngineDeadError(self.error or "the engine was shut down")
        self.engine.scheduler.validate(request_id, prompt_ids, params)
        with self.streams_lock:
            if request_id in self.streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            self.streams[request_id] = (loop, sink)
        self.commands.put(("add", request_id, prompt_ids, params))

    def abort(self, request_id: str) -> None:
        """Ends the request that holds this id now (if any); a later request with the same id is
        not touched."""
        stream = self.streams.get(request_id)
        if stream is not None:
            self.commands.put(("abort", request_id, stream))

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[dict]:
        """Blocking: run prompts to completion (the CLI's path), with one params or one each."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        sinks = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            sink = queue.Queue()
            self.add(f"gen-{uuid.uuid4().hex[:8]}-{i}", prompt, p, sink)
            sinks.append(sink)
        results = []
        for sink, p in zip(sinks, params_list):
            tokens, logprobs, out = [], [], None
            while (item := sink.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                out = item
                tokens += item.new_token_ids
                logprobs += item.logprobs or []
            results.append(
                {
                    "token_ids": tokens,
                    "finish_reason": out.finish_reason if out else None,
                    "acceptance_length": out.acceptance_length if out else 1.0,
                    "logprobs": logprobs if p.logprobs is not None else None,
                }
            )
        return results

    def stats(self) -> dict:
        s = self.engine.scheduler.stats
        return {
            "num_slots": self.engine.scheduler.num_slots,
            "num_running": self.engine.scheduler.num_running,
            "num_waiting": self.engine.scheduler.num_waiting,
            "num_steps": self.executor.timings.num_steps,
            "send_s": self.executor.timings.send_s,
            "wait_s": self.wait_s,
            "busy_s": self.busy_s,
            "device_s": self.engine.device_s,
            "worker_execute_s": self.executor.timings.execute_s,
            "num_rows": s.num_rows,
            "num_extra_rows": s.num_extra_rows,
            "num_verify_rows": s.num_verify_rows,
            "draft_proposed": s.num_draft_proposed,
            "draft_accepted": s.num_draft_accepted,
            "accepted_at": list(s.accepted_at),
            # num_draft_tokens auto: the steps that chose each K, 0 first
            "auto_steps_by_k": list(self.engine.scheduler.tuner.num_steps_by_k),
            "healthy": self.error is None,
            "scheduler": self.engine.scheduler.metrics(),
        }

    def step_age_s(self) -> float:
        """How long the step in progress has run (0 when none): a hung collective shows here."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def worker_handles(self) -> list:
        """The TP worker actors (for health checks and fault tests)."""
        return self.executor.workers

    def shutdown(self) -> None:
        self.stopped.set()
        self.commands.put(("wake",))
        self.thread.join(timeout=10)
        self.executor.shutdown()
        self.error = self.error or "the engine was shut down"
        for request_id in list(self.streams):  # requests still open end with an error, not silence
            self._emit(request_id, EngineDeadError(self.error))

    # ---- the loop thread ----

    def _emit(self, request_id: str, item) -> None:
        loop, sink = self.streams.get(request_id, (None, None))
        if sink is None:
            return
        if item is None or isinstance(item, Exception):
            self.streams.pop(request_id, None)
        if loop is None:
            sink.put(item)
            return
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody reads this stream any more
            self.streams.pop(request_id, None)
            self.engine.abort(request_id)

    def _apply(self, command) -> None:
        if command[0] == "add":
            _, request_id, prompt_ids, params = command
            try:
                self.engine.add_request(prompt_ids, params, request_id)
            except Exception as e:
                self._emit(request_id, e)
        elif command[0] == "abort":
            _, request_id, stream = command
            if self.streams.get(request_id) is stream:  # still the request that abort() meant
                self.engine.abort(request_id)
                self._emit(request_id, None)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            try:
                self._iterate()
            except Exception as e:  # a failed step, or anything else: no caller may wait forever
                self._fail_all(e)
                return

    def _iterate(self) -> None:
        try:
            command = (
                self.commands.get(timeout=0.5)
                if not self.engine.has_work
                else self.commands.get_nowait()
            )
            self._apply(command)
            return
        except queue.Empty:
            if not self.engine.has_work:
                return
        start = time.perf_counter()
        wait_before = self.executor.timings.wait_s
        self.step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self.step_started = None
        self.busy_s += time.perf_counter() - start
        self.wait_s += self.executor.timings.wait_s - wait_before
        for out in outputs:
            self._emit(out.request_id, out)
            if out.finish_reason is not None:
                self._emit(out.request_id, None)

    def _fail_all(self, error: Exception) -> None:
        self.error = str(error)
        log.error("decode loop stopped: %s", self.error)
        failure = error if isinstance(error, EngineDeadError) else EngineDeadError(self.error)
        for request_id in list(self.streams):
            self._emit(request_id, failure)
        while True:  # requests that arrive from now on fail too
            try:
                command = self.commands.get(timeout=0.5)
            except queue.Empty:
                if self.stopped.is_set():
                    return
                continue
            if command[0] == "add":
                self._emit(command[1], failure)


CoordinatorActor = ray.remote(max_concurrency=64)(Coordinator)
