"""The tensor-parallel group on Ray: `RayExecutor` places one TPWorker actor per rank in a
STRICT_PACK placement group, joins them into a process group and sends each step plan to every
rank over ZMQ (ipc on one node, tcp across nodes); rank 0 sends the results back."""

import logging
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass

import ray
import zmq
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from speculative.config import EngineConfig
from speculative.plan import StepPlan, StepResult

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The tensor-parallel group failed (a worker died or a step failed); requests in it are
    lost."""


@dataclass
class ExecutorTimings:
    num_steps: int = 0
    send_s: float = 0.0  # serialising and sending plans
    wait_s: float = 0.0  # blocked waiting for results
    execute_s: float = 0.0  # rank 0's time inside execute, summed


class RayExecutor:
    def __init__(
        self,
        cfg: EngineConfig,
        ready_timeout_s: float = 10.0,
        load_timeout_s: float = 600.0,
        collective_timeout_s: float = 60.0,
        result_timeout_s: float = 120.0,
    ):
        from workers.worker import TPWorker

        self.cfg = cfg
        self.result_timeout_s = result_timeout_s
        self.timings = ExecutorTimings()
        self.trace: list[dict] | None = None  # set to a list to record every step's timeline
        self.sent_at: dict[
            int, tuple[float, int, int]
        ] = {}  # step id -> (sent at, prefills, decodes)
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
            TPWorker.options(
                num_cpus=0 if use_gpu else 1,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=first + i
                ),
            ).remote(cfg, i, cfg.tp)
            for i in range(cfg.tp)
        ]
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
        if one_node:
            self.socket_dir = socket_dir()
            result_addr = f"ipc://{self.socket_dir}/results"
            plan_addrs = [f"ipc://{self.socket_dir}/plan-{i}" for i in range(len(self.workers))]
            self.results.bind(result_addr)
        else:
            port = self.results.bind_to_random_port(f"tcp://{here}")
            result_addr = f"tcp://{here}:{port}"
            plan_addrs = [
                f"tcp://{ip}:{port}" for ip, port in addresses
            ]  # each worker's own free port
        infos = ray.get(
            [
                w.setup.remote(master_addr, master_port, addr, result_addr, collective_timeout_s)
                for w, addr in zip(self.workers, plan_addrs)
            ],
            timeout=load_timeout_s,
        )
        self.num_slots = infos[0]["num_slots"]
        self.max_model_len = infos[0]["max_model_len"]
        self.num_blocks, self.block_size = infos[0]["num_blocks"], infos[0]["block_size"]
        self.step_costs = infos[0]["step_costs"]
        self.plans = []
        for addr in plan_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(addr)
            self.plans.append(sock)
        self.serving = [
            w.serve.remote() for w in self.workers
        ]  # resolve only if a worker stops or dies
        log.info(
            "tensor-parallel group of %d ready (%s channels)",
            len(self.workers),
            "ipc" if one_node else "tcp",
        )

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

    def send_late_grammar(self, late) -> None:
        """A step's late constrained rows' masks (speculative.plan.LateGrammar), to every rank:
        each waits for them after launching that step's target pass."""
        message = pickle.dumps(late, protocol=5)
        for sock in self.plans:
            sock.send(message)

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
                raise EngineDeadError(
                    f"no result for step {step_id} within {self.result_timeout_s:.0f} s"
                )
        result = pickle.loads(self.results.recv())
        self.timings.wait_s += time.perf_counter() - start
        if isinstance(
            result, StepFailed
        ):  # also how a dead peer shows first: rank 0's collective fails
            raise EngineDeadError(f"tensor-parallel group failed at step {step_id}: {result}")
        assert result.step_id == step_id, (
            f"result of step {result.step_id} while waiting for {step_id}"
        )
        self.timings.execute_s += result.execute_s
        if self.trace is not None and step_id in self.sent_at:
            sent_at, num_prefills, num_decodes = self.sent_at.pop(step_id)
            self.trace.append(
                {
                    "step_id": step_id,
                    "num_prefills": num_prefills,
                    "num_decodes": num_decodes,
                    "sent_at": sent_at,
                    "received_at": result.received_at,
                    "launched_at": result.launched_at,
                    "ready_at": result.ready_at,
                    "waited_at": wall_start,
                    "got_at": time.time(),
                    "device_s": result.device_s,
                }
            )
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
        if getattr(self, "socket_dir", None):
            shutil.rmtree(self.socket_dir, ignore_errors=True)


@dataclass
class PendingStep:
    executor: RayExecutor
    step_id: int

    def result(self) -> StepResult:
        return self.executor.wait_result(self.step_id)


SOCKET_DIR_PREFIX = "eagleserve-"


def socket_dir() -> str:
    """A private directory (mode 0700) for this process's ipc sockets, named by its pid: the dirs
    of processes no longer alive (a crashed run) are removed first."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        pid = name.removeprefix(SOCKET_DIR_PREFIX).split("-")[0]
        path = os.path.join(tmp, name)
        if name.startswith(SOCKET_DIR_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            if os.path.isdir(path) and os.stat(path).st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_tp_size(cfg: EngineConfig) -> None:
    """Fail before placing anything if the model's heads do not split over the ranks."""
    from workers.models import load_config
    from workers.models.loader import resolve_model

    model = load_config(resolve_model(cfg.model))
    heads = model["num_attention_heads"]
    kv_heads = model.get("num_key_value_heads", heads)
    if heads % cfg.tp or kv_heads % cfg.tp:
        sizes = [n for n in range(1, heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise ValueError(
            f"tensor-parallel size {cfg.tp} does not divide {cfg.model}'s {heads} query and "
            f"{kv_heads} key/value heads; supported sizes: {sizes}"
        )


def wants_gpu(cfg: EngineConfig) -> bool:
    if cfg.device == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    return cfg.device == "cuda"


def _reserve(tp: int, resource: str, ready_timeout_s: float):
    """One bundle per rank, all on one node; fail fast, naming what is missing, if it cannot fit."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    best = max((n["Resources"].get(resource, 0) for n in nodes), default=0)
    if best < tp:
        raise RuntimeError(
            f"tensor-parallel size {tp} needs {tp} {resource}s on one node; the largest "
            f"node of this Ray cluster has {best:g} {resource}s"
        )
    pg = placement_group([{resource: 1}] * tp, strategy="STRICT_PACK")
    ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"could not reserve {tp} {resource}s on one node within {ready_timeout_s:.0f} s "
            f"(available now: {ray.available_resources().get(resource, 0):g} {resource}s)"
        )
    return pg
