"""The Ray actor for one tensor-parallel rank: it owns that rank's ModelRunner and executes the
step plans the coordinator sends over ZMQ. Ray calls are for setup, health and shutdown only."""

import logging
import os
import pickle
import queue
import threading
import time

import ray
import torch
import zmq

from speculative.config import EngineConfig

log = logging.getLogger(__name__)
RECV_POLL_MS = 200


class StepFailed(RuntimeError):
    """Sent back instead of a StepResult when a step raised on a worker."""

    def __init__(self, step_id: int, message: str):
        super().__init__(message)
        self.step_id = step_id

    def __reduce__(self):  # RuntimeError pickles only args[0], and this class needs both
        return StepFailed, (self.step_id, str(self))


def step_profiler():
    """With EAGLESERVE_TORCH_PROFILER_DIR set (like vLLM's VLLM_TORCH_PROFILER_DIR), rank 0 profiles
    steps EAGLESERVE_PROFILE_FIRST_STEP.. (20 of them) with torch.profiler: a chrome trace and a
    table of host ops per worker process, to see where a step's launch time goes on the real
    serving path."""
    out = os.environ.get("EAGLESERVE_TORCH_PROFILER_DIR")
    if not out:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    first = int(os.environ.get("EAGLESERVE_PROFILE_FIRST_STEP", "60"))

    def write(prof):
        path = os.path.join(out, f"worker-{os.getpid()}")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(path + ".trace.json.gz")
        with open(path + ".ops.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50))

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    prof = profile(
        activities=activities,
        schedule=schedule(wait=first - 5, warmup=5, active=20, repeat=1),
        on_trace_ready=write,
    )
    prof.start()
    return prof


@ray.remote(max_concurrency=4)
class TPWorker:
    def __init__(self, cfg: EngineConfig, rank: int, world_size: int):
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
        )
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.runner = None
        self.stopped = threading.Event()
        if not torch.cuda.is_available():
            # ranks of one group share the node's cores
            threads = os.environ.get("EAGLESERVE_WORKER_THREADS") or max(
                1, (os.cpu_count() or 1) // world_size
            )
            torch.set_num_threads(int(threads))

    def node_address(self) -> tuple[str, int]:
        from workers.distributed import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(
        self,
        master_addr: str,
        master_port: int,
        plan_addr: str,
        result_addr: str,
        collective_timeout_s: float,
    ) -> dict:
        """Join the process group, load this rank's shards, connect the step channels."""
        from workers.device import pick_device
        from workers.distributed import init_tp_group
        from workers.model_runner import ModelRunner

        device = pick_device(self.cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU
            device = torch.device("cuda", 0)
        group = init_tp_group(
            self.rank, self.world_size, master_addr, master_port, device, collective_timeout_s
        )
        self.runner = ModelRunner(self.cfg, group, device)
        self.runner.late_grammar_source = self._receive_late_grammar
        self.ctx = zmq.Context()
        self.plans = self.ctx.socket(zmq.PULL)
        self.plans.bind(plan_addr)
        self.results = None
        if self.rank == 0:
            self.results = self.ctx.socket(zmq.PUSH)
            self.results.connect(result_addr)
        runner = self.runner
        return {
            "num_slots": runner.num_slots,
            "max_model_len": runner.max_model_len,
            "num_blocks": runner.num_blocks,
            "block_size": runner.block_size,
            "step_costs": runner.step_costs,
        }

    def ping(self) -> bool:
        return True

    def process_info(self) -> dict:
        """Where this rank runs: placement checks and fault tests."""
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def serve(self) -> None:
        """Execute plans until told to stop. Rank 0's results leave through a sender thread that
        waits for the device, so the next plan is launched without waiting for this one's copy."""
        outbox: queue.Queue = queue.Queue()
        sender = (
            threading.Thread(target=self._send_results, args=(outbox,), daemon=True)
            if self.rank == 0
            else None
        )
        if sender:
            sender.start()
        profiler = step_profiler() if self.rank == 0 else None
        try:
            while not self.stopped.is_set():
                if not self.plans.poll(RECV_POLL_MS):
                    continue
                plan = pickle.loads(self.plans.recv())
                if plan is None:
                    break
                try:
                    output = self.runner.execute(plan)
                except Exception as e:  # a broken step fails its requests, not the process
                    log.exception("step %d failed", plan.step_id)
                    output = StepFailed(
                        plan.step_id,
                        f"step {plan.step_id} failed on rank {self.rank}: {type(e).__name__}: {e}",
                    )
                if sender:
                    outbox.put(output)
                if profiler:
                    profiler.step()
        finally:
            if profiler:
                profiler.stop()
            if sender:
                outbox.put(None)
                sender.join(timeout=5)

    def _receive_late_grammar(self):
        """The next message, within a step: the LateGrammar the coordinator sends after it."""
        while not self.plans.poll(RECV_POLL_MS):
            if self.stopped.is_set():
                raise RuntimeError("stopped while a step waited for its late grammar masks")
        return pickle.loads(self.plans.recv())

    def _send_results(self, outbox: queue.Queue) -> None:
        while (output := outbox.get()) is not None:
            result = output if isinstance(output, StepFailed) else output.result()
            self.results.send(pickle.dumps(result, protocol=5))

    def stop(self) -> None:
        self.stopped.set()

    def shutdown(self) -> None:
        from workers.distributed import destroy_tp_group

        self.stopped.set()
        time.sleep(RECV_POLL_MS / 1000)
        destroy_tp_group()
