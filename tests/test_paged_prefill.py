"""The Triton kernels over the paged pool, run by Triton's interpreter on CPU, against the
reference (blocks gathered, SDPA under the same mask): the prefill kernel for rows of any length
(past 128 tokens it replaces the gather on CUDA), the decode kernel's rows up to 128 tokens, and
the decode kernel's split keys (flash-decoding) against no split. Shapes are small, as the
interpreter is slow, but cross block and tile boundaries. On a GPU machine, TRITON_INTERPRET=0
runs the compiled kernels on CUDA (bfloat16 included)."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
pytest.importorskip("triton")

from paged_batches import DEVICE, random_batch, reference  # noqa: E402

from workers.layers import attention_backend  # noqa: E402
from workers.layers.fp8 import to_fp8  # noqa: E402
from workers.layers.paged_attention import paged_attention, split_count  # noqa: E402
from workers.layers.paged_prefill import paged_prefill  # noqa: E402

K_PLUS_1 = 4  # a K=3 verify pass


def skip_bf16_on_cpu(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly: on CUDA only")


def tolerance(dtype) -> dict:
    return {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def blocks_for(T: int, block_size: int) -> int:
    """Enough blocks for rows of T query tokens past a context of about T more."""
    return -(-2 * T // block_size) + 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T, heads, kv_heads, D, block_size",
    [
        (300, 8, 2, 64, 16),  # several hundred tokens, GQA 4
        (200, 8, 1, 128, 32),  # GQA 8, head size 128
        (129, 4, 4, 64, 16),  # one past the decode kernel's rows, no GQA
        (128, 8, 2, 128, 16),
        (K_PLUS_1, 8, 2, 64, 16),
        (1, 8, 1, 64, 16),
    ],
)
def test_prefill_kernel_matches_the_reference(dtype, T, heads, kv_heads, D, block_size):
    """Rows of random lengths (a chunk past a context of its own length), blocks scattered."""
    skip_bf16_on_cpu(dtype)
    g = torch.Generator().manual_seed(T * 7 + heads + D)
    max_blocks = blocks_for(T, block_size)
    q, pool, batch = random_batch(g, 2, T, heads, kv_heads, D, block_size, max_blocks=max_blocks)
    q, pool = q.to(dtype), pool.to(dtype)
    out = paged_prefill(q, pool, batch)
    torch.testing.assert_close(out, reference(q, pool, batch), **tolerance(dtype))


def test_prefill_past_prefix_cached_blocks():
    """Three rows whose first four blocks are one cached prompt's, each then its own chunk of
    150 tokens: the kernel reads the shared blocks through every row's table."""
    g = torch.Generator().manual_seed(5)
    q, pool, batch = random_batch(g, 3, 150, 8, 2, 64, 16, max_blocks=26, shared_blocks=4)
    table = batch.block_table
    assert (table[1:, :4] == table[0, :4]).all() and (batch.positions[:, 0] >= 64).all()
    torch.testing.assert_close(paged_prefill(q, pool, batch), reference(q, pool, batch))


@pytest.mark.parametrize("num_splits", [2, 5])
def test_prefill_split_keys_equal_no_split(num_splits):
    """A chunk of 140 tokens past contexts of up to 480: each tile's keys over several
    programs (some empty for the first tiles), merged by their log-sum-exp, give the unsplit
    output, which is the reference's."""
    g = torch.Generator().manual_seed(num_splits)
    q, pool, batch = random_batch(g, 2, 140, 8, 2, 64, 16, max_blocks=40)
    whole = paged_prefill(q, pool, batch, num_splits=1)
    torch.testing.assert_close(whole, reference(q, pool, batch))
    split = paged_prefill(q, pool, batch, num_splits=num_splits)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_prefill_rows_read_only_their_keys():
    """Poisoning every key past each row's last query token, and every block no table names,
    changes nothing: the causal tiles never read them."""
    g = torch.Generator().manual_seed(8)
    q, pool, batch = random_batch(g, 2, 140, 4, 2, 64, 16, max_blocks=20)
    before = paged_prefill(q, pool, batch)
    unused = torch.ones(pool.shape[1], dtype=torch.bool, device=pool.device)
    unused[batch.block_table.flatten()] = False
    pool[:, unused] = float("nan")
    for row, last in enumerate(batch.positions[:, -1].tolist()):
        for key in range(last + 1, batch.kv_len):
            pool[:, batch.block_table[row, key // 16], key % 16] = float("nan")
    torch.testing.assert_close(paged_prefill(q, pool, batch), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_an_fp8_pool(dtype):
    """An FP8 pool with a layer's K and V scales: widened and scaled as read_kv does."""
    skip_bf16_on_cpu(dtype)
    g = torch.Generator().manual_seed(9)
    q, pool, batch = random_batch(g, 2, 160, 8, 2, 64, 16, max_blocks=22)
    scale = (0.02, 0.01)  # keys and values up to about 5: up to 250 of E4M3's 448
    pool8 = torch.stack([to_fp8(pool[0], scale[0]), to_fp8(pool[1], scale[1])])
    q = q.to(dtype)
    out = paged_prefill(q, pool8, batch, kv_scale=scale)
    torch.testing.assert_close(out, reference(q, pool8, batch, scale), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, heads, kv_heads, D", [(128, 8, 2, 64), (K_PLUS_1, 8, 1, 128)])
def test_decode_kernel_at_its_longest_rows(dtype, T, heads, kv_heads, D):
    """paged_attention.py's kernel at KERNEL_MAX_QUERY tokens a row and at a verify pass."""
    skip_bf16_on_cpu(dtype)
    assert T <= attention_backend.KERNEL_MAX_QUERY
    g = torch.Generator().manual_seed(T + D)
    q, pool, batch = random_batch(g, 2, T, heads, kv_heads, D, 16, max_blocks=blocks_for(T, 16))
    q, pool = q.to(dtype), pool.to(dtype)
    out = paged_attention(q, pool, batch, num_splits=1)
    torch.testing.assert_close(out, reference(q, pool, batch), **tolerance(dtype))


@pytest.mark.parametrize("T", [1, K_PLUS_1])
def test_split_keys_equal_no_split(T):
    """Flash-decoding: a row's keys over 2, 3 or 8 programs, merged by their log-sum-exp, give
    the unsplit kernel's output (rows of 20-400 keys: some splits empty)."""
    g = torch.Generator().manual_seed(T)
    q, pool, batch = random_batch(g, 3, T, 8, 2, 64, 16, max_blocks=25)
    whole = paged_attention(q, pool, batch, num_splits=1)
    for num_splits in (2, 3, 8):
        split = paged_attention(q, pool, batch, num_splits=num_splits)
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_split_count_fills_the_sms_on_small_batches_only():
    """About two programs an SM (132 SMs, an H100), no split shorter than 128 keys."""
    kv_heads = 8
    assert split_count(1 * kv_heads, 131072, 132) == 33  # batch 1 at 128k: 264 programs
    assert split_count(8 * kv_heads, 32768, 132) == 5  # batch 8 at 32k
    assert split_count(64 * kv_heads, 32768, 132) == 1  # the rows fill the GPU
    assert split_count(1 * kv_heads, 256, 132) == 2  # a short table: splits of 128 keys


def test_long_rows_take_the_prefill_kernel_unless_turned_off(monkeypatch):
    """The CUDA policy: the decode kernel up to KERNEL_MAX_QUERY, the prefill kernel past it;
    EAGLESERVE_PAGED_PREFILL=0 gathers those; the CPU always gathers."""
    cuda = torch.device("cuda")
    assert not attention_backend.use_paged_kernel(torch.device("cpu"), 1)
    monkeypatch.setattr(attention_backend, "paged_kernel_available", lambda device: True)
    assert attention_backend.use_paged_kernel(cuda, 8192)
    monkeypatch.setenv("EAGLESERVE_PAGED_PREFILL", "0")
    assert attention_backend.use_paged_kernel(cuda, attention_backend.KERNEL_MAX_QUERY)
    assert not attention_backend.use_paged_kernel(cuda, attention_backend.KERNEL_MAX_QUERY + 1)


def test_peak_step_profile_gathers_no_context_with_the_kernels(tiny_dir, monkeypatch):
    """With the kernels on (as on CUDA), the start-up peak steps prefill one row of the whole
    budget through the prefill kernel and every slot its share through the decode kernel, and
    no step copies a context: the measured peak holds none (a gathering profile takes 63 rows
    of a context each at max_model_len 131072 and a budget of 8192)."""
    if DEVICE != "cpu":
        pytest.skip("a CPU engine: the interpreter's kernels")
    from conftest import tiny_engine

    import workers.layers.attention
    import workers.layers.paged_prefill
    from workers import memory_profile

    assert memory_profile.peak_prefill_rows(256, 8192, gathers_long_rows=True)[0] == 63
    monkeypatch.setattr(attention_backend, "paged_kernel_available", lambda device: True)
    runner = tiny_engine(
        tiny_dir, max_batch_size=4, max_model_len=300, max_num_batched_tokens=256
    ).executor
    prefill_rows, gathered = [], []

    def counted_prefill(q, *args, **kwargs):
        prefill_rows.append(tuple(q.shape[:2]))
        return paged_prefill(q, *args, **kwargs)

    monkeypatch.setattr(workers.layers.paged_prefill, "paged_prefill", counted_prefill)
    monkeypatch.setattr(workers.layers.attention, "read_kv", lambda *a: gathered.append(a))
    memory_profile.run_peak_steps(runner, runner.kv.cache_len)
    assert set(prefill_rows) == {(1, 256)} and not gathered


def test_kernels_compile_for_an_h100():
    """The kernels compiled for sm_90 (pip's Triton ships ptxas; no GPU needed), in a process
    without the interpreter: what only the compiler refuses fails here, and every kernel's
    shared memory fits the H100's 227 KiB a block."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("compile_for_hopper.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shared = {
        line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1])
        for line in done.stdout.split("\n")
        if line
    }
    assert set(shared) == {
        "prefill bf16",
        "prefill bf16 window sinks",
        "prefill fp8 split",
        "decode tree split",
        "combine",
    }
    assert max(shared.values()) <= 227 * 1024
