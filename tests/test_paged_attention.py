"""The Triton paged-attention kernel, run by Triton's interpreter on CPU, against the reference
path (the blocks gathered in order, SDPA under the same mask) for random block tables, lengths,
GQA groups, query tokens per row (prefill chunks, the verify pass) and draft-tree masks. On a
GPU machine, TRITON_INTERPRET=0 runs the compiled kernel on CUDA instead."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
pytest.importorskip("triton")

from conftest import (  # noqa: E402
    replay_graphs_on_cpu,
    run_to_completion,
    tiny_engine,
    tiny_prompts,
)
from paged_batches import DEVICE, random_batch, reference  # noqa: E402

import workers.cuda_graphs  # noqa: E402
import workers.layers.attention  # noqa: E402
import workers.layers.paged_attention  # noqa: E402
import workers.layers.paged_prefill  # noqa: E402
from speculative.config import SamplingParams  # noqa: E402
from speculative.draft_tree import tree_layout  # noqa: E402
from workers.layers import attention_backend  # noqa: E402
from workers.layers.fp8 import FP8, to_fp8  # noqa: E402
from workers.layers.kv_cache import read_kv  # noqa: E402
from workers.layers.paged_attention import paged_attention  # noqa: E402
from workers.layers.paged_prefill import paged_prefill  # noqa: E402


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("T", [1, 4, 13])
@pytest.mark.parametrize("block_size", [16, 32])
def test_chain_matches_the_reference(heads, kv_heads, T, block_size):
    g = torch.Generator().manual_seed(heads * 100 + T * 10 + block_size)
    q, pool, batch = random_batch(g, 3, T, heads, kv_heads, 16, block_size)
    torch.testing.assert_close(paged_attention(q, pool, batch), reference(q, pool, batch))


@pytest.mark.parametrize("K, M", [(3, 1), (2, 2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 3)])
def test_draft_tree_matches_the_reference(K, M, heads, kv_heads):
    depth, sees = tree_layout(K, M)
    T = depth.shape[0]
    g = torch.Generator().manual_seed(K * 10 + M)
    q, pool, batch = random_batch(g, 4, T, heads, kv_heads, 16, 16, tree=(depth, sees))
    torch.testing.assert_close(paged_attention(q, pool, batch), reference(q, pool, batch))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("T, tree", [(1, None), (6, None), (7, (3, 1))])  # (3, 1): 7 nodes
def test_keys_split_across_programs_match_the_reference(num_splits, T, tree):
    """Flash-decoding: a row's keys in up to num_splits parts (some empty for short rows),
    combined by the second kernel."""
    g = torch.Generator().manual_seed(num_splits * 10 + T)
    layout = None if tree is None else tree_layout(*tree)
    assert layout is None or layout[0].shape[0] == T
    q, pool, batch = random_batch(g, 3, T, 8, 2, 32, 16, tree=layout, max_blocks=24)
    out = paged_attention(q, pool, batch, num_splits=num_splits)
    torch.testing.assert_close(out, reference(q, pool, batch))


def test_long_prefill_chunk_spans_several_query_tiles():
    """A prefill chunk of 40 tokens x a GQA group of 4: 160 query rows, three tiles of 64."""
    g = torch.Generator().manual_seed(11)
    q, pool, batch = random_batch(g, 2, 40, 8, 2, 16, 16, max_blocks=8)
    torch.testing.assert_close(paged_attention(q, pool, batch), reference(q, pool, batch))


def test_a_head_dim_short_of_a_power_of_two():
    g = torch.Generator().manual_seed(7)
    q, pool, batch = random_batch(g, 2, 3, 4, 2, 24, 16)
    torch.testing.assert_close(paged_attention(q, pool, batch), reference(q, pool, batch))


def test_rows_read_only_their_own_blocks():
    """Poisoning every block no row's table names changes nothing."""
    g = torch.Generator().manual_seed(3)
    q, pool, batch = random_batch(g, 3, 2, 4, 2, 16, 16)
    before = paged_attention(q, pool, batch)
    unused = torch.ones(pool.shape[1], dtype=torch.bool, device=pool.device)
    unused[batch.block_table.flatten()] = False
    pool[:, unused] = float("nan")
    torch.testing.assert_close(paged_attention(q, pool, batch), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, tree, num_splits", [(1, None, 1), (4, None, 1), (6, None, 3),
                                                 (7, (3, 1), 2)])  # fmt: skip
def test_fp8_pool_matches_the_reference(dtype, T, tree, num_splits):
    """An FP8 pool, K and V each divided by its layer's scale: the kernel widens and scales
    its tiles as the gather path's read_kv does, whose rows are the pool's times the scales.
    bfloat16 queries run on CUDA only (Triton's interpreter computes bfloat16 dots wrongly)."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("bfloat16 dots: on CUDA only")
    g = torch.Generator().manual_seed(T * 10 + num_splits)
    layout = None if tree is None else tree_layout(*tree)
    q, pool, batch = random_batch(g, 3, T, 8, 2, 32, 16, tree=layout, max_blocks=12)
    scale = (0.02, 0.01)  # keys and values up to about 5 each: up to 250 of E4M3's 448
    pool8 = torch.stack([to_fp8(pool[0], scale[0]), to_fp8(pool[1], scale[1])])
    assert pool8.dtype == FP8
    widened = torch.stack([pool8[0].float() * scale[0], pool8[1].float() * scale[1]])
    gathered = read_kv(pool8, batch, scale, torch.float32)
    torch.testing.assert_close(gathered, read_kv(widened, batch), rtol=0, atol=0)
    q = q.to(dtype)
    out = paged_attention(q, pool8, batch, num_splits=num_splits, kv_scale=scale)
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, reference(q, pool8, batch, scale), **tolerance)


def test_fp8_kv_cache_in_the_engine_kernel_gives_the_gather_paths_tokens(
    tmp_path, tiny_dir, tiny_drafter_dir, monkeypatch
):
    """kv_cache_dtype fp8 with a checkpoint's per-layer K and V scales: the engine's greedy
    tokens with every attention run by the kernels (prefill past 8 tokens by the prefill
    kernel; verify, drafts) are the gather path's."""
    from tiny_fp8 import write_fp8

    monkeypatch.setattr(attention_backend, "KERNEL_MAX_QUERY", 8)
    target = write_fp8(tiny_dir, tmp_path / "kv-scales", None, kv_scales=True)
    prompts = tiny_prompts(2, seed=12, min_len=20, max_len=30)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = []
    for kernel in (False, True):
        monkeypatch.setattr(
            attention_backend, "use_paged_kernel", lambda device, query_len, use=kernel: use
        )
        engine = tiny_engine(target, tiny_drafter_dir, k=3, kv_cache_dtype="fp8")
        outputs.append([r.output_ids for r in run_to_completion(engine, prompts, params)])
    assert engine.executor.kv.target.dtype == FP8
    assert engine.executor.target.layers[1].self_attn.kv_scale == pytest.approx([0.06, 0.03])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("drafter, tree", [(False, False), (True, False), (True, True)])
def test_engine_with_the_kernel_gives_the_reference_paths_tokens(
    tiny_dir, tiny_drafter_dir, monkeypatch, drafter, tree
):
    """The engine with every attention (target and drafter; prefill chunks past 16 tokens by
    the prefill kernel, verify, draft chain or tree) run by the kernels: the tokens of the
    gather-and-SDPA path, with requests joining mid-flight, a shared prefix from the prefix
    cache and prompts in chunks."""
    shared = tiny_prompts(1, seed=5, min_len=40, max_len=40)[0]
    prompts = [shared + p for p in tiny_prompts(4, seed=6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(k=3, max_num_batched_tokens=64, draft_siblings=2 if tree else 0)
    drafter_dir = tiny_drafter_dir if drafter else "none"
    calls, prefill_starts = [], []

    def counted(*args, **kwargs):
        calls.append(args[2].tree is not None)
        return paged_attention(*args, **kwargs)

    def counted_prefill(q, pool, batch, *args):
        prefill_starts.extend(batch.positions[:, 0].tolist())
        return paged_prefill(q, pool, batch, *args)

    monkeypatch.setattr(workers.layers.paged_attention, "paged_attention", counted)
    monkeypatch.setattr(workers.layers.paged_prefill, "paged_prefill", counted_prefill)
    monkeypatch.setattr(attention_backend, "KERNEL_MAX_QUERY", 16)
    outputs = []
    for kernel in (False, True):
        monkeypatch.setattr(
            attention_backend, "use_paged_kernel", lambda device, query_len, use=kernel: use
        )
        engine = tiny_engine(tiny_dir, drafter_dir, **options)
        requests = run_to_completion(engine, prompts, params, [0, 0, 2, 5])
        outputs.append([r.output_ids for r in requests])
    assert outputs[0] == outputs[1]
    assert engine.scheduler.kv.manager.stats.num_hit_tokens >= 32
    assert len(calls) > 50 and any(calls) == tree
    assert max(prefill_starts) >= 32  # chunks past a cached prefix or an earlier chunk


def test_engine_picks_the_kernel_by_query_length(tiny_dir, tiny_drafter_dir, monkeypatch):
    """The GPU's policy: the decode kernel for rows of up to KERNEL_MAX_QUERY tokens (verify,
    draft steps, short chunks), the prefill kernel past it (the prompts' chunks), nothing
    gathered. Mixed in one run, they give the gather path's tokens."""
    # a prefill bucket boundary: a padded graph bucket and its eager steps take the same kernel
    assert attention_backend.KERNEL_MAX_QUERY in workers.cuda_graphs.kv_buckets(8192, 16)
    prompts = tiny_prompts(4, seed=9, min_len=40, max_len=60)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3)
    reference_ids = [r.output_ids for r in run_to_completion(engine, prompts, params, [0, 0, 3, 3])]
    kernel_rows, prefill_rows, gather_rows = [], [], []

    def counted(q, *args, **kwargs):
        kernel_rows.append(q.shape[1])
        return paged_attention(q, *args, **kwargs)

    def counted_prefill(q, *args, **kwargs):
        prefill_rows.append(q.shape[1])
        return paged_prefill(q, *args, **kwargs)

    def counted_gather(cache, batch, *scale_and_dtype):
        gather_rows.append(batch.positions.shape[1])
        return read_kv(cache, batch, *scale_and_dtype)

    monkeypatch.setattr(workers.layers.paged_attention, "paged_attention", counted)
    monkeypatch.setattr(workers.layers.paged_prefill, "paged_prefill", counted_prefill)
    monkeypatch.setattr(workers.layers.attention, "read_kv", counted_gather)
    monkeypatch.setattr(attention_backend, "paged_kernel_available", lambda device: True)
    monkeypatch.setattr(attention_backend, "KERNEL_MAX_QUERY", 16)
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3)
    requests = run_to_completion(engine, prompts, params, [0, 0, 3, 3])
    assert [r.output_ids for r in requests] == reference_ids
    assert kernel_rows and max(kernel_rows) <= 16 and 4 in kernel_rows  # verify: 1 + K
    assert prefill_rows and min(prefill_rows) > 16  # the prompts' prefills
    assert not gather_rows


def test_graphs_bucket_by_batch_only_with_the_kernel(tiny_dir, tiny_drafter_dir, monkeypatch):
    """With the kernel, a step's graphs are captured once per batch size at the cache's whole
    length (the kernel reads each row's own keys), and a short prefill past a long cached prefix
    replays its own length's prefill graph. Replayed (eagerly on CPU, by the real StepGraphs),
    they give the gather path's tokens. Rows past 32 tokens gather (EAGLESERVE_PAGED_PREFILL=0):
    the interpreter would run the prefill kernel in every prefill graph's capture."""
    prefix = tiny_prompts(1, seed=7, min_len=320, max_len=320)[0]  # 20 blocks
    prompts = [prefix + p for p in tiny_prompts(4, seed=8, min_len=3, max_len=8)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    schedule = [0, 2, 4, 6]  # each later prompt prefills alone, past the cached prefix
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, max_model_len=512)
    reference_ids = [r.output_ids for r in run_to_completion(engine, prompts, params, schedule)]
    monkeypatch.setattr(attention_backend, "paged_kernel_available", lambda device: True)
    monkeypatch.setattr(attention_backend, "KERNEL_MAX_QUERY", 32)
    monkeypatch.setenv("EAGLESERVE_PAGED_PREFILL", "0")
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, max_model_len=512)
    runner = engine.executor
    replay_graphs_on_cpu(runner)
    for graphs in (runner.graphs.verify, runner.graphs.chain):
        assert graphs.lengths == [runner.kv.cache_len]
    requests = run_to_completion(engine, prompts, params, schedule)
    assert [r.output_ids for r in requests] == reference_ids
    assert engine.scheduler.kv.manager.stats.num_hit_tokens >= 3 * 304
    assert runner.graphs.prefill.replays == len(prompts)
    assert runner.graphs.verify.replays > 5 and runner.graphs.chain.replays > 5
