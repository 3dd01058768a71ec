"""The LLM server deployment: every replica owns one tensor-parallel group (its placement group:
the replica's bundle plus one per rank, STRICT_PACK) and the coordinator that drives it."""

import asyncio
import logging
import os
import time

import ray
from ray import serve

from deployments.api_errors import APIError
from deployments.config import ServeConfig
from deployments.replica_metrics import ReplicaMetrics
from deployments.replicas import registry
from speculative.config import SamplingParams
from speculative.engine.request import RequestError, RequestOutput

log = logging.getLogger("eagleserve.server")
# a report (a metrics snapshot, about 1 ms, and an actor call) after a request at most this often;
# the health checks report every 2 s besides
REPORT_AFTER_REQUEST_S = 1.0


@serve.deployment
class LLMServer:
    def __init__(self, cfg: ServeConfig):
        from speculative.engine.coordinator import Coordinator

        self.cfg = cfg
        self.coordinator = Coordinator(cfg.engine)
        self.num_requests = 0  # accepted by this replica (replica_info)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.metrics = ReplicaMetrics(
            cfg.model_name, self.replica_id, self.coordinator.engine.scheduler.max_model_len
        )
        self.registry = registry(context.app_name)  # /metrics and /health read every replica's
        self.reported_at = 0.0
        self._report()

    def _report(self, after_request: bool = False) -> None:
        now = time.monotonic()
        if after_request and now - self.reported_at < REPORT_AFTER_REQUEST_S:
            return
        self.reported_at = now
        self.registry.report.remote(self.replica_id, self.stats())

    def __del__(self):
        # Serve calls it when the replica stops (a graceful shutdown: gone, not failing): the
        # registry forgets it, the engine's workers go, and so does its socket directory
        if hasattr(self, "registry"):
            self.registry.forget.remote(self.replica_id)
        if hasattr(self, "coordinator"):
            self.coordinator.shutdown()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        """Stream RequestOutput deltas; cancellation (client gone) aborts the request."""
        from speculative.engine.executor import EngineDeadError

        c = self.coordinator
        scheduler = c.engine.scheduler
        free_slots = scheduler.num_slots - scheduler.num_running
        if scheduler.num_waiting + c.commands.qsize() - free_slots >= self.cfg.max_waiting_requests:
            raise APIError(
                429,
                "the server is at capacity; retry later",
                "rate_limit_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        sink = asyncio.Queue()
        try:
            c.add(request_id, prompt_ids, params, sink, asyncio.get_running_loop())
        except RequestError as e:
            raise APIError(400, str(e), code="invalid_request") from None
        except EngineDeadError as e:
            raise APIError(
                503, f"engine unavailable: {e}", "server_error", headers={"Retry-After": "5"}
            ) from None
        self.num_requests += 1
        timer = self.metrics.start_request(len(prompt_ids))
        log.info("request %s: %d prompt tokens", request_id, len(prompt_ids))
        try:
            # admitted (queued or running): an empty delta, so that the caller need not wait for the
            # first token to know (the choices of an n > 1 request wait for each other's admission)
            yield RequestOutput(request_id, [], "", None)
            while (item := await sink.get()) is not None:
                if isinstance(item, Exception):
                    timer.finish("error")
                    raise APIError(503, f"generation failed: {item}", "server_error")
                timer.output(len(item.new_token_ids), item.finish_reason)
                yield item
        finally:
            timer.finish("abort")  # the caller went away (counted once: a finished one stays)
            c.abort(request_id)
            log.info("request %s: done", request_id)
            self._report(after_request=True)

    def stats(self) -> dict:
        """The engine's statistics and this replica's metrics (a snapshot for /metrics)."""
        stats = self.coordinator.stats()
        return stats | {"replica": self.replica_id, "metrics": self.metrics.snapshot(stats)}

    async def replica_info(self) -> dict:
        """This replica's process and node, its ranks' (placement checks, fault tests), its step and
        request counts."""
        workers = await asyncio.gather(
            *[w.process_info.remote() for w in self.coordinator.worker_handles()]
        )
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "workers": workers,
            "num_steps": self.coordinator.stats()["num_steps"],
            "num_requests": self.num_requests,
        }

    def check_health(self) -> None:
        self._report()
        c = self.coordinator
        if c.error:
            raise RuntimeError(f"decode loop failed: {c.error}")
        if (age := c.step_age_s()) > self.cfg.hung_step_s:
            # a hung collective: kill the ranks so the step's requests fail now (and resume on
            # another replica) instead of waiting for Serve to replace this one
            for w in c.worker_handles():
                ray.kill(w, no_restart=True)
            raise RuntimeError(f"a step has been in flight for {age:.0f} s; the TP group is hung")


def rank_resources(cfg: ServeConfig) -> dict[str, float]:
    """One rank's placement bundle: what its TPWorker takes (a GPU, or a CPU on the CPU backend), or
    the configured `rank_resources`, which must hold that."""
    from speculative.engine.executor import wants_gpu

    needed = "GPU" if wants_gpu(cfg.engine) else "CPU"
    bundle = dict(cfg.rank_resources or {needed: 1})
    if bundle.get(needed, 0) < 1:
        raise ValueError(
            f"rank_resources {bundle} must hold at least 1 {needed}: each rank takes one"
        )
    return bundle


def llm_server_options(cfg: ServeConfig) -> dict:
    rank_bundle = rank_resources(cfg)
    # a failed replica is replaced after 3 failed checks; it gets 10 s to drain (its streams
    # resume elsewhere)
    options = {
        "placement_group_bundles": [{"CPU": 0.01}] + [rank_bundle] * cfg.engine.tp,
        "placement_group_strategy": "STRICT_PACK",
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 10,
        "ray_actor_options": {"num_cpus": 0.01},
    }
    if cfg.autoscaling:
        options["autoscaling_config"] = cfg.autoscaling.model_dump()
    else:
        options["num_replicas"] = cfg.num_replicas
    return options
