"""Step graphs keyed by batch bucket only (as where the paged kernel runs): one capture per batch
bucket serves every context length, with the eager path's tokens; and the graphs' memory is
estimated without capturing them. On CPU the graphs are the stand-in of tests/cpu_graphs.py,
which replays the captured functions eagerly (tests/test_gpu.py replays real graphs)."""

from conftest import (
    _smollm2,
    bench_questions,
    replay_graphs_on_cpu,
    run_to_completion,
    tiny_engine,
    tiny_prompts,
)
from cpu_graphs import CpuStepGraphs

from speculative.config import SamplingParams
from speculative.engine.llm_engine import encode_prompt
from workers.cuda_graphs import kv_buckets, step_graph_set

STEP_PARTS = ("verify", "target_pass", "chain")


def old_buckets(runner, kv_lens: list[int]) -> set[int]:
    """The length buckets the gather's graphs would have replayed for these kv_lens."""
    buckets = kv_buckets(runner.kv.cache_len)
    return {next(b for b in buckets if b >= n) for n in kv_lens}


def check_one_capture_per_batch_bucket(runner) -> None:
    for part in STEP_PARTS:
        graphs = getattr(runner.graphs, part)
        assert graphs.lengths == [runner.kv.cache_len]
        assert graphs.captures == len(graphs.batch_buckets) == len(graphs.graphs)


def test_one_capture_per_batch_bucket_serves_every_context_length(tiny_dir, tiny_drafter_dir):
    """Contexts from about 200 to 650 tokens (the gather's buckets 256, 512 and 1024): the eager
    path's tokens, from one capture per batch bucket of each step graph (three), where keying by
    length too would have captured several times more."""
    prompts = [p for n in (200, 300, 600) for p in tiny_prompts(1, seed=n, min_len=n, max_len=n)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    schedule = [0, 2, 5]
    config = dict(k=3, max_batch_size=4, max_model_len=1024)
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, **config)
    eager = [r.output_ids for r in run_to_completion(engine, prompts, params, schedule)]
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, **config)
    runner = engine.executor
    replay_graphs_on_cpu(runner)
    graphed = [r.output_ids for r in run_to_completion(engine, prompts, params, schedule)]
    assert graphed == eager
    check_one_capture_per_batch_bucket(runner)
    for part in ("verify", "chain"):
        replayed = getattr(runner.graphs, part).replayed_kv_lens
        assert len(old_buckets(runner, replayed)) == 3, (part, replayed)
    by_length = step_graph_set(runner, CpuStepGraphs, batch_only=False).verify
    assert len(by_length.capture_keys()) >= 3 * runner.graphs.verify.captures


def test_smollm2_graphs_keyed_by_batch_equal_eager_across_context_lengths():
    """The real SmolLM2 with its shipped drafter: contexts of 150, 300 and 500 to 520 tokens (the
    last decoding past the gather's bucket boundary 512) replay one capture per batch bucket,
    token for token the eager engine's output."""
    text = " ".join(bench_questions(20))
    config = dict(num_draft_tokens=3, max_batch_size=4, max_model_len=640)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outputs = []
    for graphed in (False, True):
        engine = _smollm2("default", **config)
        tokens = encode_prompt(engine.tokenizer, text)
        assert len(tokens) > 500
        prompts = [tokens[:n] for n in (150, 300, 500)]
        if graphed:
            replay_graphs_on_cpu(engine.executor)
        requests = run_to_completion(engine, prompts, params, [0, 3, 6])
        outputs.append([r.output_ids for r in requests])
    assert outputs[0] == outputs[1]
    assert all(len(ids) == 20 for ids in outputs[1])
    runner = engine.executor
    check_one_capture_per_batch_bucket(runner)
    assert len(old_buckets(runner, runner.graphs.verify.replayed_kv_lens)) == 3


def test_graph_memory_estimate_captures_nothing(tiny_dir, tiny_drafter_dir):
    """The estimate that sizes the pool runs each graph function once a length, at its largest
    batch, and captures nothing; the bytes it says the graphs keep (static inputs and outputs,
    scaled to each batch bucket) are what the capture then keeps."""
    runner = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, max_batch_size=8).executor
    built = step_graph_set(runner, CpuStepGraphs, batch_only=True)
    batches = []  # the batch of each run

    def measured(fn, *args, **kwargs):
        outputs = fn(*args, **kwargs)
        batches.append(outputs[0].shape[0])
        return 0, outputs

    for graphs in built.all():
        batches.clear()
        _, kept = graphs.estimate(measured)
        assert graphs.captures == 0 and not graphs.graphs
        first_of_each_length = {n: b for b, n in reversed(graphs.capture_keys())}
        assert sorted(batches) == sorted(first_of_each_length.values())
        graphs.capture_all()
        for _, _, replay in graphs.graphs.values():
            replay.replay()  # the stand-in makes a graph's outputs at its first replay
        captured = [(*inputs, *outputs) for inputs, outputs, _ in graphs.graphs.values()]
        assert kept == sum(t.nbytes for tensors in captured for t in tensors)
