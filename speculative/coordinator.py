"""The coordinator: the tensor-parallel group on Ray and the decode loop that drives it.

`RayExecutor` places one TPWorker actor per rank in a STRICT_PACK placement group, joins them
into a process group and sends each step plan to every rank over ZMQ (ipc on one node, tcp across
nodes); rank 0 sends the results back. `Coordinator` runs the overlapped loop of `LLMEngine` over
that executor in a thread and streams each request's tokens as they are accepted."""
import asyncio
import logging
import os
import pickle
import queue
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import ray
import zmq
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from speculative.config import EngineConfig, SamplingParams
from speculative.engine import LLMEngine
from speculative.plan import StepPlan, StepResult

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The tensor-parallel group failed (a worker died or a step failed); requests in it are lost."""


@dataclass
class ExecutorTimings:
    num_steps: int = 0
    send_s: float = 0.0       # serialising and sending plans
    wait_s: float = 0.0       # blocked waiting for results
    execute_s: float = 0.0    # rank 0's time inside execute, summed


class RayExecutor:
    def __init__(self, cfg: EngineConfig, ready_timeout_s: float = 10.0, load_timeout_s: float = 600.0,
                 collective_timeout_s: float = 60.0, result_timeout_s: float = 120.0):
        from workers.worker import TPWorker
        self.cfg = cfg
        self.result_timeout_s = result_timeout_s
        self.timings = ExecutorTimings()
        self.trace: list[dict] | None = None  # set to a list to record every step's timeline
        self.sent_at: dict[int, float] = {}
        check_tp_size(cfg)
        use_gpu = wants_gpu(cfg)
        resource = "GPU" if use_gpu else "CPU"
        # Inside a Serve replica the group's bundles come with the replica's placement group (after
        # the replica's own bundle); elsewhere we reserve them.
        self.pg = ray.util.get_current_placement_group()
        self.owns_pg = self.pg is None
        if self.owns_pg:
            self.pg = _reserve(cfg.tp, resource, ready_timeout_s)
        first = len(self.pg.bundle_specs) - cfg.tp
        self.workers = [
            TPWorker.options(num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(
                                 self.pg, placement_group_bundle_index=first + i))
            .remote(cfg, i, cfg.tp) for i in range(cfg.tp)]
        try:
            self._connect(load_timeout_s, collective_timeout_s)
        except Exception:
            self.shutdown()
            raise

    def _connect(self, load_timeout_s: float, collective_timeout_s: float) -> None:
        addresses = ray.get([w.node_address.remote() for w in self.workers], timeout=load_timeout_s)
        master_addr, master_port = addresses[0]
        here = ray.util.get_node_ip_address()
        one_node = all(ip == here for ip, _ in addresses)
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        tag = uuid.uuid4().hex[:12]
        if one_node:
            base = os.path.join(tempfile.gettempdir(), f"eagleserve-{tag}")
            result_addr = f"ipc://{base}-results"
            plan_addrs = [f"ipc://{base}-plan-{i}" for i in range(len(self.workers))]
            self.results.bind(result_addr)
        else:
            port = self.results.bind_to_random_port(f"tcp://{here}")
            result_addr = f"tcp://{here}:{port}"
            plan_addrs = [f"tcp://{ip}:{port}" for ip, port in addresses]  # each worker's own free port
        infos = ray.get([w.setup.remote(master_addr, master_port, addr, result_addr, collective_timeout_s)
                         for w, addr in zip(self.workers, plan_addrs)], timeout=load_timeout_s)
        self.num_slots = infos[0]["num_slots"]
        self.max_model_len = infos[0]["max_model_len"]
        self.plans = []
        for addr in plan_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(addr)
            self.plans.append(sock)
        self.serving = [w.serve.remote() for w in self.workers]  # resolve only if a worker stops or dies
        log.info("tensor-parallel group of %d ready (%s channels)", len(self.workers), "ipc" if one_node else "tcp")

    def execute(self, plan: StepPlan) -> "PendingStep":
        start = time.perf_counter()
        message = pickle.dumps(plan, protocol=5)
        for sock in self.plans:
            sock.send(message)
        self.timings.send_s += time.perf_counter() - start
        self.timings.num_steps += 1
        if self.trace is not None:
            self.sent_at[plan.step_id] = (time.time(), len(plan.prefills), len(plan.decode_slots))
        return PendingStep(self, plan.step_id)

    def wait_result(self, step_id: int) -> StepResult:
        from workers.worker import StepFailed
        start, wall_start = time.perf_counter(), time.time()
        deadline = start + self.result_timeout_s
        while not self.results.poll(50):
            done, _ = ray.wait(self.serving, timeout=0)
            if done:
                try:
                    ray.get(done)
                    reason = "a worker stopped serving"
                except Exception as e:
                    reason = f"a worker died: {type(e).__name__}: {str(e).splitlines()[0]}"
                raise EngineDeadError(f"tensor-parallel group failed at step {step_id}: {reason}")
            if time.perf_counter() > deadline:
                raise EngineDeadError(f"no result for step {step_id} within {self.result_timeout_s:.0f} s")
        result = pickle.loads(self.results.recv())
        self.timings.wait_s += time.perf_counter() - start
        if isinstance(result, StepFailed):
            raise EngineDeadError(str(result))
        assert result.step_id == step_id, f"result of step {result.step_id} while waiting for {step_id}"
        self.timings.execute_s += result.execute_s
        if self.trace is not None and step_id in self.sent_at:
            sent_at, num_prefills, num_decodes = self.sent_at.pop(step_id)
            self.trace.append({"step_id": step_id, "num_prefills": num_prefills, "num_decodes": num_decodes,
                               "sent_at": sent_at, "received_at": result.received_at,
                               "launched_at": result.launched_at, "ready_at": result.ready_at,
                               "waited_at": wall_start, "got_at": time.time(), "device_s": result.device_s})
        return result

    def shutdown(self) -> None:
        for sock in getattr(self, "plans", []):
            try:
                sock.send(pickle.dumps(None), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self.owns_pg:
            remove_placement_group(self.pg)
        if hasattr(self, "ctx"):
            self.ctx.destroy(linger=0)


@dataclass
class PendingStep:
    executor: RayExecutor
    step_id: int

    def result(self) -> StepResult:
        return self.executor.wait_result(self.step_id)


def check_tp_size(cfg: EngineConfig) -> None:
    """Fail before placing anything if the model's heads do not split over the ranks."""
    from workers.loader import load_config, resolve_model
    model = load_config(resolve_model(cfg.model))
    heads = model["num_attention_heads"]
    kv_heads = model.get("num_key_value_heads", heads)
    if heads % cfg.tp or kv_heads % cfg.tp:
        sizes = [n for n in range(1, heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise ValueError(f"tensor-parallel size {cfg.tp} does not divide {cfg.model}'s {heads} query and "
                         f"{kv_heads} key/value heads; supported sizes: {sizes}")


def wants_gpu(cfg: EngineConfig) -> bool:
    if cfg.device == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    return cfg.device == "cuda"


def _reserve(tp: int, resource: str, ready_timeout_s: float):
    """One bundle per rank, all on one node; fail fast, naming what is missing, if it cannot fit."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    best = max((n["Resources"].get(resource, 0) for n in nodes), default=0)
    if best < tp:
        raise RuntimeError(f"tensor-parallel size {tp} needs {tp} {resource}s on one node; the largest "
                           f"node of this Ray cluster has {best:g} {resource}s")
    pg = placement_group([{resource: 1}] * tp, strategy="STRICT_PACK")
    ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(f"could not reserve {tp} {resource}s on one node within {ready_timeout_s:.0f} s "
                           f"(available now: {ray.available_resources().get(resource, 0):g} {resource}s)")
    return pg


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
        self.error: str | None = None
        self.wait_s = 0.0           # loop time spent blocked on workers
        self.busy_s = 0.0           # loop time with work to do
        self.step_started: float | None = None  # monotonic start of the engine step in progress
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="coordinator-loop", daemon=True)
        self.thread.start()

    # ---- called from other threads ----

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink=None, loop=None) -> None:
        """Validate now (errors raise here), then enqueue for the loop thread."""
        if self.error:
            raise EngineDeadError(self.error)
        self.engine.scheduler.validate(request_id, prompt_ids, params)
        self.streams[request_id] = (loop, sink)
        self.commands.put(("add", request_id, prompt_ids, params))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
        """Blocking: run prompts to completion (the CLI's path)."""
        sinks = []
        for i, prompt in enumerate(prompts):
            sink = queue.Queue()
            self.add(f"gen-{uuid.uuid4().hex[:8]}-{i}", prompt, params, sink)
            sinks.append(sink)
        results = []
        for sink in sinks:
            tokens, out = [], None
            while (item := sink.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                out = item
                tokens += item.new_token_ids
            results.append({"token_ids": tokens, "finish_reason": out.finish_reason if out else None,
                            "acceptance_length": out.acceptance_length if out else 1.0})
        return results

    def stats(self) -> dict:
        s = self.engine.scheduler.stats
        return {"num_running": self.engine.scheduler.num_running, "num_waiting": self.engine.scheduler.num_waiting,
                "num_steps": self.executor.timings.num_steps, "send_s": self.executor.timings.send_s,
                "wait_s": self.wait_s, "busy_s": self.busy_s, "device_s": self.engine.device_s, "worker_execute_s": self.executor.timings.execute_s,
                "num_rows": s.num_rows, "num_extra_rows": s.num_extra_rows, "num_verify_rows": s.num_verify_rows,
                "draft_proposed": s.num_draft_proposed, "draft_accepted": s.num_draft_accepted,
                "accepted_at": list(s.accepted_at), "healthy": self.error is None}

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

    # ---- the loop thread ----

    def _emit(self, request_id: str, item) -> None:
        loop, sink = self.streams.get(request_id, (None, None))
        if sink is None:
            return
        if loop is None:
            sink.put(item)
        else:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        if item is None or isinstance(item, Exception):
            self.streams.pop(request_id, None)

    def _apply(self, command) -> None:
        if command[0] == "add":
            _, request_id, prompt_ids, params = command
            try:
                self.engine.add_request(prompt_ids, params, request_id)
            except Exception as e:
                self._emit(request_id, e)
        elif command[0] == "abort":
            self.engine.abort(command[1])
            self._emit(command[1], None)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            try:
                command = self.commands.get(timeout=0.5) if not self.engine.has_work else self.commands.get_nowait()
                self._apply(command)
                continue
            except queue.Empty:
                if not self.engine.has_work:
                    continue
            start = time.perf_counter()
            wait_before = self.executor.timings.wait_s
            self.step_started = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._fail_all(e)
                return
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
