"""The weight-only FP8 kernel (workers/layers/fp8_weight_only.py) at Llama-3.1-8B's linear shapes
and a step's row counts, against torch._scaled_mm (activations quantized per token), bf16's
F.linear and FP8's weight-read floor; then a sweep of block configurations at a few row counts,
to say where block_config's choice stands against the best; and the row count up to which
weight-only beats _scaled_mm at every shape (fp8.WEIGHT_ONLY_MAX_ROWS's measurement). Each
configuration runs before it is timed (compile, first launch), and is timed as a CUDA graph's
replay, as the engine's steps run. Prints tables, writes JSON.

    python3 benchmarks/gpu/fp8_weight_only_bench.py -o $OUT           # on a GPU (~2 minutes)
    python3 benchmarks/gpu/fp8_weight_only_bench.py --tiny -o /tmp/x  # CPU dry run (interpreter)
"""

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import runner_bench as rb  # noqa: E402
from benchmarks.gpu.fp8_checks import SHAPES_8B, relative  # noqa: E402
from benchmarks.step_floor import bandwidth_bytes_per_s  # noqa: E402
from workers.layers import fp8  # noqa: E402
from workers.layers.fp8_weight_only import block_config, weight_only_product  # noqa: E402

ROWS = [1, 6, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
SWEEP_ROWS = [1, 16, 32, 64, 192]
SWEEP = {"block_n": [32, 64, 128], "block_k": [128, 256], "split": [1, 2, 4],
         "warps": [4, 8], "stages": [3], "swap": [False, True]}  # fmt: skip


def device_us(fn, device, repeats: int) -> float:
    """Microseconds a call on the device: on CUDA `repeats` calls captured in one graph and
    replayed (as the engine's steps run: no launch overhead), warmed first; elsewhere wall time."""
    if device.type != "cuda":
        return 1000 * rb.time_ms(fn, device, repeats)
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return 1000 * rb.time_ms(graph.replay, device, 5) / repeats


def operands(N, K, M, device, dtype):
    g = torch.Generator(device=device).manual_seed(N + K + M)
    x = torch.randn(M, K, device=device, generator=g).to(dtype)
    w = (torch.randn(N, K, device=device, generator=g) * 0.02).to(dtype)
    return x, w, *fp8.quantize_rows(w)


def point(name, N, K, M, device, dtype, bandwidth, sms, repeats) -> dict:
    x, w, w8, scale = operands(N, K, M, device, dtype)
    exact = x.float() @ (w8.float() * scale[:, None]).t()
    ours = weight_only_product(x, w8, scale, None, sms)
    row = {"shape": name, "N": N, "K": K, "M": M, "config": block_config(M, N, K, sms),
           "weight_only_rel_err": relative(ours, exact),
           "weight_only_us": device_us(
               lambda: weight_only_product(x, w8, scale, None, sms), device, repeats),
           "bf16_us": device_us(lambda: F.linear(x, w), device, repeats),
           "fp8_read_floor_us": 1e6 * N * K / bandwidth}  # fmt: skip
    if fp8.uses_scaled_mm(x, w8):

        def scaled():
            return fp8.scaled_mm_product(*fp8.quantize_per_token(x), w8, scale, dtype)

        row["scaled_mm_us"] = device_us(scaled, device, repeats)
    return row


def sweep(name, N, K, M, device, dtype, sms, repeats) -> dict:
    """Every configuration of SWEEP, with block_config's rows a tile and all rows in one tile
    (each weight read once)."""
    x, _, w8, scale = operands(N, K, M, device, dtype)
    tiles = {block_config(M, N, K, sms)[0], max(16, min(256, 1 << (M - 1).bit_length())), 16}
    timed = {}
    for block_m, (bn, bk, split, warps, stages, swap) in itertools.product(
        sorted(tiles), itertools.product(*SWEEP.values())
    ):
        if K // split < bk or (block_m >= 128 and (bn, bk) == (128, 256)):
            continue
        config = (block_m, bn, bk, split, warps, stages, swap)
        run = lambda c=config: weight_only_product(x, w8, scale, None, sms, c)  # noqa: E731
        try:
            timed[config] = device_us(run, device, repeats)
        except Exception as e:  # noqa: BLE001  a tile too large for shared memory
            if "out of resource" not in str(e):
                raise
    best = min(timed, key=timed.get)
    chosen = block_config(M, N, K, sms)
    return {"shape": name, "M": M, "best_config": best, "best_us": timed[best],
            "chosen_config": chosen, "chosen_us": timed.get(chosen)}  # fmt: skip


def max_rows_where_weight_only_wins(rows: list[dict]) -> int:
    """The largest M up to which weight-only is at least as fast as _scaled_mm at every shape."""
    best = 0
    for M in sorted({r["M"] for r in rows}):
        at = [r for r in rows if r["M"] == M]
        if any(r["weight_only_us"] > r.get("scaled_mm_us", float("inf")) for r in at):
            break
        best = M
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU dry run: tiny shapes")
    p.add_argument("-o", "--output", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args()
    device = rb.pick_device("cpu" if args.tiny else "auto")
    dtype = torch.float16 if args.tiny else torch.bfloat16  # the interpreter's bf16 dots are off
    shapes = {"tiny": (64, 128)} if args.tiny else SHAPES_8B
    rows_list, sweep_rows = ([1, 6], [1]) if args.tiny else (ROWS, SWEEP_ROWS)
    repeats = 2 if args.tiny else 50
    sms = 132 if args.tiny else torch.cuda.get_device_properties(device).multi_processor_count
    if args.tiny:
        SWEEP.update(block_n=[32], block_k=[64], split=[1, 2], warps=[4], stages=[3])
    bandwidth = bandwidth_bytes_per_s(device)
    points = [(n, N, K, M) for n, (N, K) in shapes.items() for M in rows_list]
    rows = [point(*pt, device, dtype, bandwidth, sms, repeats) for pt in tqdm(points, "points")]
    sweeps = [sweep(n, N, K, M, device, dtype, sms, max(2, repeats // 5))
              for n, (N, K) in tqdm(shapes.items(), "sweep") for M in sweep_rows]  # fmt: skip
    out = {"device": rb.device_name(device), "dtype": str(dtype),
           "bandwidth_tb_s": bandwidth / 1e12, "rows": rows, "sweep": sweeps,
           "weight_only_max_rows": max_rows_where_weight_only_wins(rows)}  # fmt: skip
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "fp8_weight_only.json").write_text(json.dumps(out, indent=1) + "\n")
    print_tables(out)


def print_tables(out: dict) -> None:
    print(f"{out['device']}: every configuration run before it is timed")
    print("shape      M   weight-only us  scaled_mm us  bf16 us  fp8 floor us  x floor  rel err")
    for r in out["rows"]:
        sm = r.get("scaled_mm_us", float("nan"))
        print(f"{r['shape']:>8} {r['M']:>4} {r['weight_only_us']:>14.1f} {sm:>13.1f} "
              f"{r['bf16_us']:>8.1f} {r['fp8_read_floor_us']:>13.1f} "
              f"{r['weight_only_us'] / r['fp8_read_floor_us']:>8.2f} "
              f"{r['weight_only_rel_err']:>8.1e}")  # fmt: skip
    print("shape      M   chosen config           us   best config             us")
    for s in out["sweep"]:
        chosen = s["chosen_us"] if s["chosen_us"] is not None else float("nan")
        print(f"{s['shape']:>8} {s['M']:>4}   {str(s['chosen_config']):<22} {chosen:>6.1f}   "
              f"{str(s['best_config']):<22} {s['best_us']:>6.1f}")  # fmt: skip
    print(f"weight-only at least as fast as _scaled_mm up to M = {out['weight_only_max_rows']}")


if __name__ == "__main__":
    main()
