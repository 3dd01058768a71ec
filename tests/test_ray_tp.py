"""The Ray execution path: TP worker actors + coordinator, on a local Ray
cluster with CPU (gloo)."""

import asyncio
import queue
import time

import pytest
import ray
import torch
from tiny_models import tiny_llama as _tiny_llama

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.coordinator import Coordinator, CoordinatorActor
from speculative.engine.executor import EngineDeadError
from speculative.engine.llm_engine import LLMEngine, encode_prompt
from speculative.engine.request import RequestError
from workers.models.loader import load_tokenizer, resolve_model

QUESTIONS = [
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Name three colors of the rainbow.",
    "Explain what a prime number is.",
]
GREEDY = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    return [encode_prompt(tokenizer, q) for q in QUESTIONS]


def run_coordinator(cfg: EngineConfig, prompts, params=GREEDY, key="token_ids"):
    coordinator = CoordinatorActor.remote(cfg)
    try:
        return [r[key] for r in ray.get(coordinator.generate.remote(prompts, params))], ray.get(
            coordinator.stats.remote()
        )
    finally:
        ray.get(coordinator.shutdown.remote())
        ray.kill(coordinator)


@pytest.fixture(scope="module")
def local_outputs(prompts):
    cfg = EngineConfig(drafter="none", max_batch_size=4, max_model_len=512)
    return [r.output_ids for r in LLMEngine(cfg).generate(prompts, GREEDY)]


@pytest.mark.parametrize("drafter", ["none", "default"])
def test_tp3_matches_single_process(prompts, local_outputs, drafter):
    cfg = EngineConfig(drafter=drafter, max_batch_size=4, max_model_len=512, tp=3)
    outputs, stats = run_coordinator(cfg, prompts)
    assert outputs == local_outputs
    assert stats["num_steps"] > 0 and stats["healthy"]


def test_tp1_overlap_equals_no_overlap(prompts, local_outputs):
    results = {}
    for overlap in (True, False):
        cfg = EngineConfig(drafter="default", max_batch_size=4, max_model_len=512, overlap=overlap)
        results[overlap], _ = run_coordinator(cfg, prompts)
    assert results[True] == results[False] == local_outputs


def test_tp_size_not_dividing_heads_fails_at_start():
    with pytest.raises(
        Exception, match=r"tensor-parallel size 2 does not divide .* 9 query and 3 key/value heads"
    ):
        ray.get(CoordinatorActor.remote(EngineConfig(tp=2, drafter="none")).stats.remote())


def test_missing_resources_fail_fast():
    start = time.perf_counter()
    with pytest.raises(
        Exception, match=r"needs 6 CPUs on one node; the largest node of this Ray cluster has 4"
    ):
        ray.get(
            CoordinatorActor.remote(
                EngineConfig(tp=6, drafter="none", model=str(_tiny6_dir()))
            ).stats.remote()
        )
    assert time.perf_counter() - start < 30


def _tiny6_dir():
    import tempfile
    from pathlib import Path

    return _tiny_llama(Path(tempfile.mkdtemp()) / "tiny-h6", heads=6, kv_heads=6, hidden=96)


def test_tp2_matches_tp1_on_small_model(tmp_path, prompts):
    """Tokens and their log-probabilities (rank 0's, sent back over the result channel)."""
    model = str(_tiny_llama(tmp_path / "tiny"))
    outputs = {}
    for tp in (1, 2):
        cfg = EngineConfig(
            model=model, drafter="default", max_batch_size=4, max_model_len=256, tp=tp
        )
        outputs[tp], _ = run_coordinator(
            cfg, prompts, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2), key="logprobs"
        )
    tokens = {tp: [[t for _, top in o for t, _ in top[:1]] for o in outputs[tp]] for tp in (1, 2)}
    assert tokens[1] == tokens[2]  # greedy: each token is its top one
    assert all(len(o) == 16 and all(len(top) == 2 for _, top in o) for o in outputs[1])
    torch.testing.assert_close(
        torch.tensor([[lp for lp, _ in o] for o in outputs[1]]),
        torch.tensor([[lp for lp, _ in o] for o in outputs[2]]),
        rtol=1e-4,
        atol=1e-4,
    )


def test_killed_worker_fails_requests_then_engine_restarts(prompts, local_outputs):
    cfg = EngineConfig(drafter="none", max_batch_size=4, max_model_len=512, tp=3)
    coordinator = CoordinatorActor.remote(cfg)
    workers = ray.get(coordinator.worker_handles.remote())
    pending = coordinator.generate.remote(prompts, SamplingParams(max_tokens=400, ignore_eos=True))
    time.sleep(3)
    ray.kill(workers[1])
    start = time.perf_counter()
    with pytest.raises(EngineDeadError, match="tensor-parallel group failed"):
        ray.get(pending, timeout=60)
    assert time.perf_counter() - start < 20
    assert ray.get(coordinator.stats.remote())["healthy"] is False
    with pytest.raises(EngineDeadError):  # new requests fail clearly instead of hanging
        ray.get(coordinator.generate.remote(prompts[:1], GREEDY), timeout=30)
    ray.get(coordinator.shutdown.remote())
    ray.kill(coordinator)
    outputs, _ = run_coordinator(cfg, prompts)
    assert outputs == local_outputs


def _drain(sink) -> list | Exception:
    """A stream's outputs up to its end (None), or the exception that ended it."""
    items = []
    while (item := sink.get(timeout=60)) is not None:
        if isinstance(item, Exception):
            return item
        items.append(item)
    return items


def test_request_ids_callers_and_shutdown(tmp_path):
    """A duplicate id is refused without harming the request that holds it; aborting an id after its
    request finished (as LLMServer does) leaves a new request with that id alone; a caller whose
    event loop closed does not stop the loop; shutdown ends open requests with an error."""
    model = _tiny_llama(tmp_path / "tiny", layers=2)
    c = Coordinator(
        EngineConfig(
            model=str(model), drafter="none", max_batch_size=2, max_model_len=128, device="cpu"
        )
    )
    eight = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        first = queue.Queue()
        c.add("x", [1, 2, 3], eight, first)
        with pytest.raises(RequestError, match="already in use"):
            c.add("x", [4, 5], eight, queue.Queue())
        assert sum(len(o.new_token_ids) for o in _drain(first)) == 8
        c.abort("x")  # x has finished: nothing to abort
        second = queue.Queue()
        c.add("x", [1, 2, 3], eight, second)
        assert sum(len(o.new_token_ids) for o in _drain(second)) == 8

        loop = asyncio.new_event_loop()
        c.add("gone", [1, 2], SamplingParams(max_tokens=60, ignore_eos=True), asyncio.Queue(), loop)
        loop.close()
        third = queue.Queue()
        c.add("y", [1, 2], eight, third)
        assert sum(len(o.new_token_ids) for o in _drain(third)) == 8 and c.stats()["healthy"]

        hanging = queue.Queue()
        c.add("z", [1, 2], SamplingParams(max_tokens=100, ignore_eos=True), hanging)
    finally:
        c.shutdown()
    assert isinstance(_drain(hanging), EngineDeadError)
    with pytest.raises(EngineDeadError, match="shut down"):
        c.add("late", [1], eight, queue.Queue())


@ray.remote(num_cpus=1)
class _GroupMember:
    def join(self, rank, port):
        from workers.distributed import init_tp_group

        init_tp_group(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=3)
        return True

    def lonely_all_reduce(self):
        import torch.distributed as dist

        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1))
        except Exception as e:
            return f"{type(e).__name__}", time.perf_counter() - start
        return "completed", time.perf_counter() - start


def test_collective_that_never_completes_times_out():
    from workers.distributed import free_port

    port = free_port()
    members = [_GroupMember.remote() for _ in range(2)]
    assert ray.get([m.join.remote(r, port) for r, m in enumerate(members)], timeout=60) == [
        True,
        True,
    ]
    outcome, seconds = ray.get(members[0].lonely_all_reduce.remote(), timeout=60)
    assert outcome != "completed"
    assert seconds < 30
    for m in members:
        ray.kill(m)


def test_step_failed_survives_the_trip_back():
    """Rank 0 pickles a StepFailed onto the results socket: its step id and message must arrive."""
    import pickle

    from workers.worker import StepFailed

    error = pickle.loads(pickle.dumps(StepFailed(7, "step 7 failed on rank 0: ValueError: boom")))
    assert (error.step_id, str(error)) == (7, "step 7 failed on rank 0: ValueError: boom")


def test_step_profiler_profiles_the_steps_after_the_first_n(tmp_path, monkeypatch):
    """EAGLESERVE_TORCH_PROFILER_DIR makes a worker profile 20 steps and write a trace and a table
    of host ops; unset, there is no profiler."""
    from workers.worker import step_profiler

    assert step_profiler() is None
    monkeypatch.setenv("EAGLESERVE_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("EAGLESERVE_PROFILE_FIRST_STEP", "6")
    prof = step_profiler()
    x = torch.ones(8, 8)
    for step in range(30):
        x = x @ x / 8
        prof.step()
        if step == 20:
            assert not list(tmp_path.iterdir()), "written before the 20 profiled steps were over"
    prof.stop()
    table = next(tmp_path.glob("worker-*.ops.txt")).read_text()
    assert "aten::mm" in table
    assert next(tmp_path.glob("worker-*.trace.json.gz")).stat().st_size > 0
