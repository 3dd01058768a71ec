"""The Triton kernels over the paged pool on one GPU, at a Llama-3.1-8B layer's attention shape
(32 query heads, 8 KV heads, head dim 128, bf16, blocks of 16):

- check: the compiled kernels' largest error against the reference (blocks gathered, SDPA).
- prefill: paged_prefill.py's kernel against the gather + SDPA it replaces for rows past 128
  tokens, as the engine ran them eagerly (read_kv, the mask folded over the GQA group, the
  memory-efficient kernel), one row's prompt chunk of 8k tokens at 8k and 32k of context and of
  32k at 32k, a float32 chunk of 2k at SmolLM2-135M's layer, and rows just past the switch
  (256 at 32k, 512 at 4k: the kernel with its keys split, the default there, and without, and
  the decode kernel): ms, TFLOP/s of the causal attention, each path's peak memory above its
  inputs; then the kernel's tiles at 8k.
- decode: paged_attention.py's kernel with each row's keys split over programs (flash-decoding,
  the default split count, and twice it) against no split, batch 1 and 8 at 8k, 32k and 128k,
  one query token a row and six (a K=5 verify pass): ms a call in CUDA graphs, GB/s of K/V
  read, against the card's nominal bandwidth and a device-to-device copy's.

Writes paged_kernels_gpu.json under $OUT (or --output) and prints the tables.

    python3 benchmarks/paged_kernels_gpu.py [--output DIR]
    python3 benchmarks/paged_kernels_gpu.py --tiny   # CPU dry run, Triton's interpreter
"""

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

TINY = "--tiny" in sys.argv
if TINY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]
from paged_attention_gpu import DEVICE, LAYER, make_batch, mask_bias, time_ms  # noqa: E402

from workers.layers.kv_cache import read_kv  # noqa: E402
from workers.layers.paged_attention import (  # noqa: E402
    default_splits,
    paged_attention,
    query_tiles,
)
from workers.layers.paged_prefill import PrefillTiles, paged_prefill  # noqa: E402

DTYPE = torch.float32 if TINY else torch.bfloat16  # the interpreter's bf16 dots are wrong
# (layer, dtype, chunk tokens, context); float32 at SmolLM2-135M's layer, whose dots run
# without tensor cores in both paths
PREFILL = [(LAYER, DTYPE, T, context) for T, context in ((8192, 8192), (8192, 32768),
                                                         (32768, 32768))]  # fmt: skip
PREFILL.append(((9, 3, 64), torch.float32, 2048, 2048))
# just past the switch, where a short chunk past a long cached prefix leaves the prefill kernel
# few tiles: its keys split (the default) and not, and the decode kernel
PREFILL += [(LAYER, DTYPE, T, context) for T, context in ((256, 32768), (512, 4096))]
DECODE_KERNEL_MAX = 512  # query tokens up to which the decode kernel is timed beside it
TILES = [PrefillTiles(*t) for t in ((128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 2),
                                    (128, 128, 8, 2), (128, 32, 4, 3))]  # fmt: skip
DECODE = [(B, c, T) for B in (1, 8) for c in (8192, 32768, 131072) for T in (1, 6)]
# (dtypes, heads, KV heads, head dim, query tokens, context): float32 dots at head dim 128
# take 20 s to compile, and the tests check them
CHECKS = [((torch.bfloat16,), 32, 8, 128, 1000, 3000)]
CHECKS += [((torch.float32, torch.bfloat16), *c) for c in ((8, 1, 64, 300, 1000),
                                                          (4, 4, 64, 129, 500))]  # fmt: skip
if TINY:
    PREFILL, TILES = [(LAYER, DTYPE, 160, 160), (LAYER, DTYPE, 160, 320)], TILES[:2]
    DECODE_KERNEL_MAX = 160
    DECODE, CHECKS = [(1, 512, 1), (2, 1024, 6)], [((torch.float32,), 4, 2, 32, 140, 300)]
# nominal HBM bandwidth, GB/s, by a part of the device's name
NOMINAL_GBS = {"H100 PCIe": 2000, "H100 NVL": 3900, "H100": 3350, "H200": 4800, "A100": 2039}


def nominal_gbs(name: str) -> float | None:
    return next((gbs for part, gbs in NOMINAL_GBS.items() if part in name), None)


def copy_gbs() -> float | None:
    """A device-to-device copy of 1 GiB: bytes read and written a second."""
    if TINY:
        return None
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return round(2 * 2**30 / (time_ms(lambda: dst.copy_(src), repeats=10) * 1e-3) / 1e9, 1)


def events_ms(fn, repeats=3) -> float:
    """Per call, launched eagerly (a long prefill's launches are nothing beside its work)."""
    fn()
    if TINY:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def peak_gb(fn) -> float | None:
    """GiB a call allocates above what was allocated before it, at its peak."""
    if TINY:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)


def gather_folded(q, pool, batch):
    """The engine's eager path for a long row (cuDNN off outside graphs, so the query heads of a
    GQA group fold into the query length): the mask, the gathered K/V, then SDPA."""
    B, T, H, D = q.shape
    KV = pool.shape[3]
    group = H // KV
    bias = mask_bias(q, batch).unsqueeze(3).expand(B, 1, T, group, batch.kv_len)
    bias = bias.reshape(B, 1, T * group, batch.kv_len)
    kv = read_kv(pool, batch)  # [2, B, KV, S, D]
    folded = q.reshape(B, T, KV, group, D).transpose(1, 2).reshape(B, KV, T * group, D)
    out = torch.nn.functional.scaled_dot_product_attention(folded, kv[0], kv[1], attn_mask=bias)
    return out.reshape(B, KV, T, group, D).transpose(1, 2).reshape(B, T, H, D)


def max_error(out, want) -> float:
    return (out.float() - want.float()).abs().max().item()


def check_results() -> list[dict]:
    rows = []
    for dtypes, heads, kv_heads, D, T, context in CHECKS:
        for dtype in dtypes:
            shape = {"dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "D": D}
            q, pool, batch = make_batch(2, T, heads, kv_heads, D, context, dtype)
            error = max_error(paged_prefill(q, pool, batch), gather_folded(q, pool, batch))
            rows.append({"kernel": "prefill", "T": T, **shape, "max_abs_error": error})
            q, pool, batch = make_batch(2, 6, heads, kv_heads, D, context, dtype)
            want = gather_folded(q, pool, batch)
            for splits in (1, 5):
                out = paged_attention(q, pool, batch, num_splits=splits)
                rows.append({"kernel": f"decode, {splits} splits", "T": 6, **shape,
                             "max_abs_error": max_error(out, want)})  # fmt: skip
    return rows


def causal_tflop(T: int, context: int, heads: int, D: int) -> float:
    """QK^T and PV of T tokens at the end of `context`, each seeing the keys up to itself."""
    keys_seen = T * (context - T) + T * (T + 1) // 2
    return 4 * keys_seen * heads * D / 1e12


def measure_prefill(rows: list[dict]) -> None:
    for layer, dtype, T, context in PREFILL:
        q, pool, batch = make_batch(1, T, *layer, context, dtype)
        tflop = causal_tflop(T, context, layer[0], layer[2])
        paths = {"kernel": partial(paged_prefill, q, pool, batch),
                 "gather": partial(gather_folded, q, pool, batch)}  # fmt: skip
        if T <= DECODE_KERNEL_MAX:  # the kernel's keys unsplit, and the decode kernel
            paths["unsplit"] = partial(paged_prefill, q, pool, batch, num_splits=1)
            paths["decode_kernel"] = partial(paged_attention, q, pool, batch)
        row = {"layer": layer, "dtype": str(dtype), "tokens": T, "context": context}
        for name, fn in paths.items():
            try:
                ms = events_ms(fn)
            except torch.cuda.OutOfMemoryError:  # the gather's copies past the card's memory
                row |= {f"{name}_ms": None, f"{name}_tflops": None, f"{name}_peak_gb": "OOM"}
                empty_cache()
                continue
            row |= {f"{name}_ms": round(ms, 3), f"{name}_tflops": round(tflop / ms * 1e3, 1),
                    f"{name}_peak_gb": peak_gb(fn)}  # fmt: skip
        timed = row["gather_ms"] and row["kernel_ms"]
        row["speedup"] = round(row["gather_ms"] / row["kernel_ms"], 2) if timed else None
        rows.append(row)
        print(row)
        del q, pool, batch, paths
        empty_cache()


def measure_tiles(rows: list[dict]) -> None:
    """The prefill kernel's tiles (block_m, block_n, warps, stages) at the first shape."""
    _, _, T, context = PREFILL[0]
    q, pool, batch = make_batch(1, T, *LAYER, context, DTYPE)
    tflop = causal_tflop(T, context, LAYER[0], LAYER[2])
    for tiles in TILES:
        try:
            ms = events_ms(partial(paged_prefill, q, pool, batch, tiles=tiles))
        except Exception as e:  # a tile that does not fit the SM's shared memory
            rows.append({**tiles._asdict(), "error": str(e)[:200]})
            continue
        timed = {"ms": round(ms, 3), "tflops": round(tflop / ms * 1e3, 1)}
        rows.append({**tiles._asdict(), **timed})
        print(rows[-1])


def measure_decode(rows: list[dict], card_gbs: float | None) -> None:
    heads, kv_heads, D = LAYER
    element = torch.finfo(DTYPE).bits // 8
    for B, context, T in DECODE:
        q, pool, batch = make_batch(B, T, *LAYER, context, DTYPE)
        programs = B * kv_heads * query_tiles(T, heads // kv_heads)[1]
        default = default_splits(programs, batch.kv_len, q.device)
        gb = 2 * B * context * kv_heads * D * element / 1e9  # K and V, read once
        for splits in sorted({1, default, 2 * default}):
            ms = time_ms(partial(paged_attention, q, pool, batch, num_splits=splits))
            gbs = gb / ms * 1e3
            rows.append({"batch": B, "context": context, "tokens": T, "splits": splits,
                         "default": splits == default, "ms": round(ms, 4),
                         "gb_per_s": round(gbs, 1),
                         "of_card": round(gbs / card_gbs, 3) if card_gbs else None})  # fmt: skip
        del q, pool, batch
        empty_cache()


def empty_cache() -> None:
    if not TINY:
        torch.cuda.empty_cache()


def print_tables(result: dict) -> None:
    print(f"{result['device']}: nominal {result['nominal_gb_per_s']} GB/s, "
          f"copy {result['copy_gb_per_s']} GB/s")  # fmt: skip
    for dtype in {r["dtype"] for r in result["check"]}:
        worst = max(r["max_abs_error"] for r in result["check"] if r["dtype"] == dtype)
        print(f"check {dtype}: max abs error {worst:.2e}")
    columns = ["dtype", "tokens", "context", "kernel_ms", "kernel_tflops", "kernel_peak_gb",
               "gather_ms", "gather_tflops", "gather_peak_gb", "speedup",
               "unsplit_ms", "decode_kernel_ms"]  # fmt: skip
    print(" ".join(f"{c:>14}" for c in columns))
    for r in result["prefill"]:
        print(" ".join(f"{r.get(c)!s:>14}" for c in columns))
    print(f"{'batch':>5} {'context':>7} {'T':>2} {'splits':>6} {'ms':>8} {'GB/s':>7} {'card':>5}")
    for r in result["decode"]:
        mark = "*" if r["default"] else " "
        print(f"{r['batch']:>5} {r['context']:>7} {r['tokens']:>2} {r['splits']:>5}{mark} "
              f"{r['ms']:>8} {r['gb_per_s']:>7} {r['of_card']!s:>5}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--tiny", action="store_true", help="CPU dry run: Triton's interpreter")
    args = p.parse_args()
    name = "cpu (Triton interpreter)" if TINY else torch.cuda.get_device_name()
    if not TINY:
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine's eager steps
    result = {"device": name, "nominal_gb_per_s": nominal_gbs(name), "copy_gb_per_s": None,
              "check": [], "prefill": [], "tiles": [], "decode": []}  # fmt: skip
    path = args.output / "paged_kernels_gpu.json"
    save = lambda: path.write_text(json.dumps(result, indent=1))  # noqa: E731
    result["copy_gb_per_s"] = copy_gbs()
    result["check"] = check_results()
    save()
    card = result["nominal_gb_per_s"]
    for part, measure in (("decode", lambda r: measure_decode(r, card)),
                          ("prefill", measure_prefill), ("tiles", measure_tiles)):  # fmt: skip
        measure(result[part])
        save()
    print_tables(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
