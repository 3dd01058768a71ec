"""The Triton paged-attention kernel on a GPU: compiled results against the reference path
(blocks gathered, SDPA under the same mask), with its default split of the keys and without,
then its speed against the engine's gather path (read_kv, then cuDNN's GQA attention, as the
engine's graphs run it) at a Llama-3.1-8B layer's attention shape (32 query heads, 8 KV heads,
head dim 128, bf16, blocks of 16) for batch 1, 8, 32, contexts 1k, 8k, 32k, one query token a
row (decode) and six (a K=5 verify pass), plus prefill chunks and the rows around the
engine's switch from the kernel to the gather (32 to 256 tokens). Both are timed in
CUDA graphs of 20 calls; the kernel also with the same rows in a 32k-token block table, as the
graphs' batch-only buckets run it. Writes JSON under $OUT (or --output) and prints a table.

    python3 benchmarks/paged_attention_gpu.py [--output DIR]
    python3 benchmarks/paged_attention_gpu.py --tiny   # CPU dry run, Triton's interpreter
"""

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

TINY = "--tiny" in sys.argv
if TINY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
DEVICE = "cpu" if TINY else "cuda"
# (query heads, KV heads, head dim) and the speed shapes: batch, context, query tokens a row
LAYER = (4, 2, 32) if TINY else (32, 8, 128)
SHAPES = [(B, context, T) for B in (1, 8, 32) for context in (1024, 8192, 32768) for T in (1, 6)]
SHAPES += [(1, 4096, 512), (4, 8192, 512)]  # prefill chunks past a context
# where the engine switches from the kernel to the gather (KERNEL_MAX_QUERY): trees, chunks
SHAPES += [(B, 4096, T) for B in (1, 8) for T in (32, 81, 128, 256)]
LONG_TABLE = 32768  # the block table of a graph captured for the longest context
CHECK_CONTEXT = 3000
CHECK_DTYPES, SPEED_DTYPE = (torch.float32, torch.bfloat16), torch.bfloat16
if TINY:  # Triton 3.9's interpreter computes bf16 dots wrongly (a 16x16 test: off by 1e10)
    SHAPES, LONG_TABLE, CHECK_CONTEXT = [(1, 128, 1), (2, 128, 6), (1, 64, 40)], 256, 200
    CHECK_DTYPES, SPEED_DTYPE = (torch.float32,), torch.float32

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculative.draft_tree import tree_layout  # noqa: E402
from workers.layers.attention import hidden_keys  # noqa: E402
from workers.layers.kv_cache import ForwardBatch, read_kv  # noqa: E402
from workers.layers.paged_attention import paged_attention  # noqa: E402


def make_batch(
    B, T, heads, kv_heads, D, context, dtype, tree=None, block_size=16, seed=0, table_len=None
):
    """Rows of `context` tokens over shuffled blocks; T query tokens at each row's end. A
    table_len past the context: the block table (and kv_len) of a graph captured for longer."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    max_blocks = -(-(table_len or context) // block_size)
    num_blocks = B * max_blocks
    pool = torch.randn(2, num_blocks + 1, block_size, kv_heads, D, device=DEVICE, generator=g)
    table = torch.randperm(num_blocks, device=DEVICE, generator=g).view(B, max_blocks)
    base = torch.full((B,), context - T, device=DEVICE)
    columns = torch.arange(T, device=DEVICE)
    positions = base.unsqueeze(1) + (columns if tree is None else tree[0].to(DEVICE))
    rows = base.unsqueeze(1) + columns
    sees = None if tree is None else tree[1].to(DEVICE)
    batch = ForwardBatch(torch.arange(B, device=DEVICE), positions, rows, rows, rows, table,
                         max_blocks * block_size, sees)  # fmt: skip
    q = torch.randn(B, T, heads, D, device=DEVICE, generator=g)
    return q.to(dtype), pool.to(dtype), batch


def mask_bias(q, batch):
    """The additive mask [B, 1, T, S] the engine builds once a forward."""
    hidden = hidden_keys(batch).unsqueeze(1)
    bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device)
    return bias.masked_fill_(hidden, float("-inf"))


def reference(q, pool, batch):
    return gather_sdpa(q, pool, batch, mask_bias(q, batch))


def check_results() -> list[dict]:
    rows = []
    depth_sees = tree_layout(3, 1)
    cases = [(4, 2, 1, None), (9, 3, 4, None), (32, 8, 6, None), (8, 2, 7, depth_sees)]
    cases.append((32, 8, 100, None))
    for dtype in CHECK_DTYPES:
        for (heads, kv_heads, T, tree), splits in itertools.product(cases, (None, 1, 3)):
            if tree is not None:
                T = tree[0].shape[0]
            q, pool, batch = make_batch(3, T, heads, kv_heads, 64, CHECK_CONTEXT, dtype, tree)
            out = paged_attention(q, pool, batch, num_splits=splits)
            error = (out - reference(q, pool, batch)).abs().max()
            rows.append({"dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "T": T,
                         "tree": tree is not None, "splits": splits or "default",
                         "max_abs_error": error.item()})  # fmt: skip
    return rows


def time_ms(fn, repeats=20) -> float:
    """Per call, replaying a CUDA graph of `repeats` calls, as the engine runs its steps."""
    if TINY:  # no graphs on a CPU: the interpreter's time, to show the code runs
        return eager_ms(fn, repeats=1)
    fn()  # compiles the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def eager_ms(fn, repeats=2 if TINY else 50) -> float:
    """Per call, launched eagerly from Python (wall time: the launch overhead shows)."""
    fn()
    sync = torch.cuda.synchronize if not TINY else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / repeats


def gather_sdpa(q, pool, batch, bias):
    """The engine's path without the kernel, a layer's share of it: gather the blocks, then
    cuDNN's GQA attention (as the engine's graphs run it) under a mask built once a forward."""
    kv = read_kv(pool, batch)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), kv[0], kv[1], attn_mask=bias, enable_gqa=True
    )
    return out.transpose(1, 2)


def measure_speed(rows: list[dict], save) -> None:
    """Appends a row per shape to `rows`, calling save() after each."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    for B, context, T in tqdm(SHAPES, desc="shapes"):
        q, pool, batch = make_batch(B, T, *LAYER, context, SPEED_DTYPE)
        bias = mask_bias(q, batch)
        kernel = time_ms(lambda q=q, p=pool, b=batch: paged_attention(q, p, b))
        gather = time_ms(lambda q=q, p=pool, b=batch, m=bias: gather_sdpa(q, p, b, m))
        del q, pool, batch, bias
        # the graphs' batch-only buckets: the same rows in a table as long as the longest
        q, pool, batch = make_batch(B, T, *LAYER, context, SPEED_DTYPE, table_len=LONG_TABLE)
        long_table = time_ms(lambda q=q, p=pool, b=batch: paged_attention(q, p, b))
        rows.append({"batch": B, "context": context, "tokens_per_row": T,
                     "triton_ms": round(kernel, 4), "gather_sdpa_ms": round(gather, 4),
                     "speedup": round(gather / kernel, 2),
                     "triton_32k_table_ms": round(long_table, 4)})  # fmt: skip
        save()
        del q, pool, batch
        torch.cuda.empty_cache()


# eager steps (a suffix past a cached prefix, steps no graph fits): SmolLM2-135M's layer and
# the 8B one; batch, context, query tokens a row
EAGER_SHAPES = [((9, 3, 64), 1, 2520, 36), ((9, 3, 64), 1, 2520, 1), (LAYER, 1, 1024, 6)]


def measure_eager(rows: list[dict]) -> None:
    """Both paths launched eagerly: wall time per call, as an eager step pays it."""
    for layer, B, context, T in EAGER_SHAPES:
        q, pool, batch = make_batch(B, T, *layer, context, SPEED_DTYPE)
        bias = mask_bias(q, batch)  # built once a forward, for all layers
        kernel = eager_ms(lambda q=q, p=pool, b=batch: paged_attention(q, p, b))
        gather = eager_ms(lambda q=q, p=pool, b=batch, m=bias: gather_sdpa(q, p, b, m))
        rows.append({"layer": layer, "batch": B, "context": context, "tokens_per_row": T,
                     "triton_eager_ms": round(kernel, 4),
                     "gather_eager_ms": round(gather, 4)})  # fmt: skip
        print(rows[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--tiny", action="store_true", help="CPU dry run: Triton's interpreter")
    args = p.parse_args()
    device = "cpu (Triton interpreter)" if TINY else torch.cuda.get_device_name()
    result = {"device": device, "results": check_results(), "speed": [], "eager": []}
    measure_eager(result["eager"])
    print(json.dumps(result["results"], indent=1))
    path = args.output / "paged_attention_gpu.json"
    measure_speed(result["speed"], lambda: path.write_text(json.dumps(result, indent=2)))
    print(f"{'batch':>5} {'context':>7} {'T':>3} {'triton ms':>10} {'gather ms':>10} {'x':>6} "
          f"{'32k table':>10}")  # fmt: skip
    for r in result["speed"]:
        print(f"{r['batch']:>5} {r['context']:>7} {r['tokens_per_row']:>3} {r['triton_ms']:>10} "
              f"{r['gather_sdpa_ms']:>10} {r['speedup']:>6} "
              f"{r['triton_32k_table_ms']:>10}")  # fmt: skip


if __name__ == "__main__":
    main()
