"""The fused MoE kernel (workers/layers/fused_moe.py) at Qwen3-30B-A3B's and Mixtral-8x7B's
expert layers, for the token counts of decode and verify steps (batch 1, 8, 32 at K = 0 and 5),
against the loop over experts (the CPU path, eager: it reads the routing back to the host) and
the floor of reading the experts the tokens chose once; bf16 and FP8 expert weights. Checks that
the kernel equals the loop (bf16: the CPU tests cannot, Triton's interpreter computes bf16 dots
wrongly) and that its CUDA graph's replay equals its eager run bit for bit. Then a sweep of block
configurations at a few token counts, to say where block_config's choice stands. Each
configuration runs before it is timed; the kernel is timed as a CUDA graph's replay, as the
engine's steps run. Prints tables, writes JSON.

    python3 benchmarks/gpu/moe_kernel_bench.py -o $OUT           # on a GPU (about 2 minutes)
    python3 benchmarks/gpu/moe_kernel_bench.py --tiny -o /tmp/x  # CPU dry run (interpreter)
"""

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import runner_bench as rb  # noqa: E402
from benchmarks.gpu.fp8_weight_only_bench import device_us  # noqa: E402
from benchmarks.step_floor import bandwidth_bytes_per_s  # noqa: E402
from workers.layers.fp8 import quantize_rows  # noqa: E402
from workers.layers.fused_moe import block_config, fused_moe  # noqa: E402
from workers.layers.moe import moe_reference, route  # noqa: E402

LAYERS = {  # name -> (experts, top-k, hidden, expert intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = [1, 6, 8, 32, 48, 192]  # batch 1, 8, 32 at K = 0 and 5
SWEEP_TOKENS = [1, 48, 192]
SWEEP = {"block_m": [16, 32, 64], "block_n": [32, 64, 128], "block_k": [64, 128],
         "warps": [4, 8], "stages": [3, 4]}  # fmt: skip


def experts(E, H, inter, device, dtype, fp8: bool):
    g = torch.Generator(device=device).manual_seed(E + H)
    w13 = torch.randn(E, 2 * inter, H, device=device, generator=g).mul_(0.02).to(dtype)
    w2 = torch.randn(E, H, inter, device=device, generator=g).mul_(0.02).to(dtype)
    if not fp8:
        return w13, w2, None, None
    (q13, s13), (q2, s2) = quantize_rows(w13.flatten(0, 1)), quantize_rows(w2.flatten(0, 1))
    return q13.view(w13.shape), q2.view(w2.shape), s13.view(E, -1), s2.view(E, -1)


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def point(layer, weights, T, device, dtype, bandwidth, repeats) -> dict:
    E, k, H, inter = LAYERS[layer]
    g = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    route_weights, ids = route(torch.randn(T, E, device=device, generator=g), k, True)
    args = (x, weights[0], weights[1], route_weights, ids, weights[2], weights[3])
    eager = fused_moe(*args)
    row = {
        "layer": layer,
        "tokens": T,
        "fp8": weights[2] is not None,
        "rel_err_vs_loop": relative(eager, moe_reference(*args)),
        "fused_us": device_us(lambda: fused_moe(*args), device, repeats),
        "loop_us": 1000 * rb.time_ms(lambda: moe_reference(*args), device, max(2, repeats // 4)),
    }
    if device.type == "cuda":  # the replay of a graph captured with these inputs
        graph, out = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(graph):
            out = fused_moe(*args)
        graph.replay()
        row["graph_equals_eager"] = bool(torch.equal(out, eager))
    per_expert = sum(w[0].nbytes for w in weights[:2])  # one expert's w13 and w2 bytes
    row["experts_touched"] = int(ids.unique().numel())
    row["floor_us"] = 1e6 * row["experts_touched"] * per_expert / bandwidth
    row["x_floor"] = row["fused_us"] / row["floor_us"]
    return row


def sweep(layer, weights, device, dtype, repeats) -> list[dict]:
    E, k, H, inter = LAYERS[layer]
    rows = []
    for T in SWEEP_TOKENS:
        g = torch.Generator(device=device).manual_seed(T)
        x = torch.randn(T, H, device=device, generator=g).to(dtype)
        rw, ids = route(torch.randn(T, E, device=device, generator=g), k, True)
        args = (x, weights[0], weights[1], rw, ids, weights[2], weights[3])
        for bm, bn, bk, warps, stages in itertools.product(*SWEEP.values()):
            configs = ((bm, bn, bk, warps, stages),) * 2
            run = functools.partial(fused_moe, *args, configs=configs)
            us = device_us(run, device, repeats)
            rows.append({"layer": layer, "tokens": T, "config": configs[0], "us": us})
    return rows


def print_rows(rows) -> None:
    print(f"{'layer':>14} {'fp8':>5} {'tokens':>6} {'fused us':>9} {'loop us':>9} "
          f"{'floor us':>9} {'x floor':>7} {'experts':>7} {'rel err':>8} graph=eager")  # fmt: skip
    for r in rows:
        print(f"{r['layer']:>14} {r['fp8']!s:>5} {r['tokens']:>6} {r['fused_us']:>9.1f} "
              f"{r['loop_us']:>9.1f} {r['floor_us']:>9.1f} {r['x_floor']:>6.2f}x "
              f"{r['experts_touched']:>7} {r['rel_err_vs_loop']:>8.1e} "
              f"{r.get('graph_equals_eager', '-')}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: small layers, interpreter")
    p.add_argument("-o", "--output", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        LAYERS.clear()
        LAYERS["tiny"] = (8, 2, 64, 48)
        TOKENS[:], SWEEP_TOKENS[:], args.repeats = [1, 12], [4], 2
        SWEEP.update(block_m=[16], block_n=[32, 64], block_k=[64], warps=[4], stages=[3])
    bandwidth = bandwidth_bytes_per_s(device)
    out = {"device": rb.device_name(device), "dtype": str(dtype),
           "bandwidth_tb_s": bandwidth / 1e12,
           "default_configs": {n: [block_config(l[2]), block_config(l[3])]
                               for n, l in LAYERS.items()},
           "rows": [], "sweep": []}  # fmt: skip
    for layer, fp8 in tqdm(list(itertools.product(LAYERS, (False, True))), desc="layers"):
        E, _, H, inter = LAYERS[layer]
        weights = experts(E, H, inter, device, dtype, fp8)
        out["rows"] += [point(layer, weights, T, device, dtype, bandwidth, args.repeats)
                        for T in TOKENS]  # fmt: skip
        if not args.no_sweep and not fp8:
            out["sweep"] += sweep(layer, weights, device, dtype, args.repeats)
        del weights
        rb.free_memory()
    print(f"{out['device']}, {dtype}, bandwidth {out['bandwidth_tb_s']:.2f} TB/s")
    print_rows(out["rows"])
    for layer, T in itertools.product(LAYERS, SWEEP_TOKENS):
        best = min((r for r in out["sweep"] if r["layer"] == layer and r["tokens"] == T),
                   key=lambda r: r["us"], default=None)  # fmt: skip
        if best:
            print(f"sweep {layer} at {T} tokens: best {best['config']} {best['us']:.1f} us")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "moe_kernel.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output / 'moe_kernel.json'}")


if __name__ == "__main__":
    main()
