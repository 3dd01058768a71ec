"""The paged KV pool end to end on the tiny target: a pool too small for the batch preempts
requests and recomputes them, a shared prefix is found in the prefix cache, and neither changes
a token; a request that could never fit is refused; the pool is whole again afterwards."""

import pytest
from conftest import replay_graphs_on_cpu, run_to_completion, tiny_engine, tiny_prompts

from speculative.config import SamplingParams
from speculative.engine.request import RequestError

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
JOINS = [0, 0, 1, 3, 4, 9, 15]  # engine steps before each request joins
BLOCK_BYTES = 16 * 1280  # a 16-token block of the tiny target (4 layers) and drafter (1 layer)


def pool_gb(num_blocks: int) -> float:
    return num_blocks * BLOCK_BYTES / 2**30


@pytest.fixture(scope="module")
def prompts():
    """A 40-token prefix shared by every prompt, then its own tokens."""
    shared = tiny_prompts(1, seed=9, min_len=40, max_len=40)[0]
    return [shared + p for p in tiny_prompts(len(JOINS), seed=3)]


@pytest.fixture(scope="module")
def plain_ref(tiny_dir, prompts):
    engine = tiny_engine(tiny_dir, enable_prefix_caching=False)
    return [r.output_ids for r in run_to_completion(engine, prompts, GREEDY)]


def assert_pool_whole(engine) -> None:
    """No request holds a block once all are done (cached blocks count as free)."""
    manager = engine.scheduler.kv.manager
    assert manager.num_free == manager.num_blocks
    assert manager.ref_counts == [0] * manager.num_blocks


def test_block_size_matches_the_pool_arithmetic(tiny_dir, tiny_drafter_dir):
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, kv_cache_memory_gb=pool_gb(20))
    assert engine.executor.num_blocks == 20
    assert engine.executor.kv.target.shape[2:4] == (21, 16)  # the dummy block too


@pytest.mark.parametrize("k, siblings", [(1, 0), (3, 0), (3, 2)])
def test_tiny_pool_preempts_and_stays_exact(
    tiny_dir, tiny_drafter_dir, prompts, plain_ref, k, siblings
):
    """20 blocks hold about two requests: the newest ones give their blocks back and are
    recomputed, while others join mid-flight, and the tokens are plain decoding's."""
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir, k=k, max_batch_size=4, draft_siblings=siblings,
        kv_cache_memory_gb=pool_gb(20),
    )  # fmt: skip
    requests = run_to_completion(engine, prompts, GREEDY, JOINS)
    assert [r.output_ids for r in requests] == plain_ref
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.kv.manager.stats.num_hit_tokens > 0
    assert_pool_whole(engine)


def streaming(engine) -> dict:
    """Record every output the engine streams, per request id."""
    streamed, step = {}, engine.step

    def step_and_record():
        outputs = step()
        for out in outputs:
            streamed.setdefault(out.request_id, []).append(out)
        return outputs

    engine.step = step_and_record
    return streamed


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("drafter", ["none", "drafter"])
def test_preemption_with_chunks_is_exact_with_overlap_on_and_off(
    tiny_dir, tiny_drafter_dir, prompts, plain_ref, overlap, drafter
):
    """Requests of different lengths join mid-flight on a 12-block pool under a 32-token step
    budget: prompts prefill in chunks, the newest requests give their blocks back (between
    chunks, or with a step in flight that ends them) and are recomputed. Each streams plain
    decoding's tokens once, and the pool and the slots come back whole."""
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir if drafter == "drafter" else "none", k=3, max_batch_size=4,
        max_num_batched_tokens=32, kv_cache_memory_gb=pool_gb(12), overlap=overlap,
    )  # fmt: skip
    plans, execute = [], engine.executor.execute
    engine.executor.execute = lambda plan: plans.append(plan) or execute(plan)
    streamed = streaming(engine)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 17, 33, 9, 40, 26, 5)]
    requests = run_to_completion(engine, prompts, params, JOINS)
    expected = [ref[: p.max_tokens] for ref, p in zip(plain_ref, params)]
    assert [r.output_ids for r in requests] == expected
    for r in requests:
        outputs = streamed[r.request_id]
        assert [t for out in outputs for t in out.new_token_ids] == r.output_ids
        assert [out.finish_reason for out in outputs] == [None] * (len(outputs) - 1) + ["length"]
    assert all(None not in p.slots and len(set(p.slots)) == len(p.slots) for p in plans)
    assert any(row.next_token >= 0 for p in plans for row in p.prefills)  # chunked
    scheduler = engine.scheduler
    assert scheduler.stats.num_preemptions > 0
    assert not scheduler.waiting and not scheduler.running
    assert sorted(scheduler.free_slots) == list(range(4))
    assert_pool_whole(engine)


def test_preemption_keeps_seeded_sampling(tiny_dir, tiny_drafter_dir, prompts):
    """A sampled token depends on its request's seed and position only, so a recomputed request
    draws what it would have drawn."""
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)

    def run(**overrides):
        engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, max_batch_size=4, **overrides)
        return engine, [r.output_ids for r in run_to_completion(engine, prompts, params, JOINS)]

    _, roomy = run()
    tight, squeezed = run(kv_cache_memory_gb=pool_gb(16))
    assert squeezed == roomy and tight.scheduler.stats.num_preemptions > 0
    assert_pool_whole(tight)


def test_prefix_cache_hits_give_the_same_tokens(tiny_dir, tiny_drafter_dir, prompts, plain_ref):
    """One request after another: each finds the shared prefix (and nothing else) cached."""
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3)
    outputs = [run_to_completion(engine, [p], GREEDY)[0].output_ids for p in prompts]
    assert outputs == plain_ref
    stats = engine.scheduler.kv.manager.stats
    assert stats.num_queried_tokens == sum(map(len, prompts))
    # the 40-token prefix holds two whole blocks, found by every request after the first
    assert stats.num_hit_tokens == 32 * (len(prompts) - 1)
    assert_pool_whole(engine)


def test_prefix_caching_off_finds_nothing(tiny_dir, prompts, plain_ref):
    engine = tiny_engine(tiny_dir, enable_prefix_caching=False)
    outputs = [run_to_completion(engine, [p], GREEDY)[0].output_ids for p in prompts[:3]]
    assert outputs == plain_ref[:3]
    assert engine.scheduler.kv.manager.stats.num_hit_tokens == 0


def test_a_request_that_can_never_fit_is_refused(tiny_dir, tiny_drafter_dir):
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, kv_cache_memory_gb=pool_gb(4))
    with pytest.raises(RequestError, match="can never fit the KV cache pool of 4 blocks x 16"):
        engine.add_request(list(range(40)), SamplingParams(max_tokens=40))
    # what fits still runs, and leaves the pool whole
    (r,) = run_to_completion(engine, [list(range(10))], SamplingParams(max_tokens=5))
    assert len(r.output_ids) == 5
    assert_pool_whole(engine)


def test_a_flood_on_a_tiny_pool_finishes_without_leaking(tiny_dir, tiny_drafter_dir):
    """Thirty requests on a pool that holds about three: queued, preempted, all served."""
    engine = tiny_engine(
        tiny_dir, tiny_drafter_dir, k=3, max_batch_size=8, kv_cache_memory_gb=pool_gb(12)
    )
    flood = tiny_prompts(30, seed=11, max_len=30)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    requests = run_to_completion(engine, flood, params, [i // 3 for i in range(30)])
    assert all(len(r.output_ids) == 20 and r.finish_reason == "length" for r in requests)
    assert_pool_whole(engine)
    assert sorted(engine.scheduler.free_slots) == list(range(8))


def test_a_long_prompt_is_chunked_while_a_stream_keeps_going(tiny_dir, tiny_drafter_dir):
    """A 150-token prompt under a 32-token step budget: it prefills over several steps, each of
    which also verifies the running request, and both give the unchunked engine's tokens."""
    (running_prompt,) = tiny_prompts(1, seed=21)
    (long_prompt,) = tiny_prompts(1, seed=22, min_len=150, max_len=150)
    stream = SamplingParams(max_tokens=60, ignore_eos=True)
    ref_engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3)
    ref = [r.output_ids for r in run_to_completion(ref_engine, [running_prompt, long_prompt],
                                                   [stream, GREEDY], [0, 3])]  # fmt: skip
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, max_num_batched_tokens=32)
    plans, plan = [], engine.scheduler.plan
    engine.scheduler.plan = lambda: plans.append(plan()) or plans[-1]
    running = engine.add_request(running_prompt, stream)
    for _ in range(3):
        engine.step()
    late = engine.add_request(long_prompt, GREEDY)
    while engine.has_work:
        engine.step()
    assert [running.output_ids, late.output_ids] == ref
    chunked = [p for p in plans if p is not None and any(r.next_token >= 0 for r in p.prefills)]
    assert len(chunked) >= 4
    # every one of those steps verifies the running request too, within the budget
    assert all(len(p.decode_slots) == 1 for p in chunked)
    assert all(sum(len(r.token_ids) for r in p.prefills) + 4 <= 32 for p in chunked)


def test_scheduler_metrics_follow_the_pool(tiny_dir, prompts):
    """vLLM's metric names: running and waiting requests, the pool's usage, prefix-cache
    queries and hits in tokens, preemptions; exported as vLLM's series."""
    from deployments.metrics import IngressMetrics, exposition
    from deployments.replica_metrics import ReplicaMetrics

    engine = tiny_engine(tiny_dir, max_batch_size=2)
    for p in prompts[:3]:
        engine.add_request(p, GREEDY)
    engine.step()
    busy = engine.scheduler.metrics()
    assert busy["num_requests_running"] == 2 and busy["num_requests_waiting"] == 1
    assert 0 < busy["kv_cache_usage_perc"] <= 1
    while engine.has_work:
        engine.step()
    done = engine.scheduler.metrics()
    assert done["num_requests_running"] == 0 and done["kv_cache_usage_perc"] == 0
    assert done["prefix_cache_queries_total"] == sum(map(len, prompts[:3]))
    assert done["prefix_cache_hits_total"] == 32  # the third found the shared prefix
    assert done["num_preemptions_total"] == 0
    engine_stats = {
        "draft_proposed": 0, "draft_accepted": 0, "num_verify_rows": 0, "healthy": True,
        "num_steps": 0, "num_extra_rows": 0, "accepted_at": [], "scheduler": done,
    }  # fmt: skip
    snapshot = ReplicaMetrics("tiny", "r1", 64).snapshot(engine_stats)
    text = exposition(IngressMetrics(), "tiny", {"r1": {"metrics": snapshot}}).decode()
    labels = '{engine="0",model_name="tiny",replica="r1"}'
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text
    assert f"vllm:prefix_cache_hits_total{labels} 32.0\n" in text
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in text
    assert "vllm:spec_decode" not in text  # no draft method, no speculation counters (as vLLM)


@pytest.mark.parametrize("speculative", [False, True])
def test_prefills_after_a_cached_prefix_in_the_graphed_function(
    tiny_dir, tiny_drafter_dir, prompts, plain_ref, speculative
):
    """What the prefill graph runs, padded as it pads, from past a cached prefix: the tokens of
    plain decoding without the cache (tests/test_gpu.py replays the real graph)."""
    engine = tiny_engine(tiny_dir, tiny_drafter_dir if speculative else "none", k=3)
    graphs = replay_graphs_on_cpu(engine.executor, "prefill").prefill
    outputs = [run_to_completion(engine, [p], GREEDY)[0].output_ids for p in prompts]
    assert outputs == plain_ref
    assert graphs.replays == len(prompts)  # every prefill, all but the first past the prefix
    assert engine.scheduler.kv.manager.stats.num_hit_tokens == 32 * (len(prompts) - 1)
