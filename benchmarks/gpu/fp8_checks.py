"""FP8 on one GPU: the checks benchmarks/gpu/fp8_gpu_job.sh runs besides step_floor.py.

gemm      torch._scaled_mm against the widened fallback at Llama-3.1-8B's linear shapes and
          the verify pass's token counts (batch 1, 8, 32 x K+1 = 6): max relative error of
          each against the float32 product of the same FP8 operands, and of FP8 against the
          bf16 weights; their times against bf16's F.linear and the weight-read floor; one
          CUDA graph of fp8_linear replayed against eager (no host sync inside)
kernel    the compiled paged kernel over an FP8 pool against the gather path (bf16 queries,
          8B's heads, chain and tree masks, key splits), and its time over a bf16 pool's
capacity  the KV tokens gpu_memory_utilization 0.9 leaves for an 8B target: bf16 weights and
          KV, bf16 weights with an FP8 KV cache, FP8 weights and KV cache
summary   the step_floor.py runs side by side (bf16 and FP8 verify against FP8's floor)

  python3 benchmarks/gpu/fp8_checks.py gemm kernel capacity -o $OUT
  python3 benchmarks/gpu/fp8_checks.py gemm kernel capacity --tiny -o /tmp/x   # CPU dry run
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import runner_bench as rb  # noqa: E402
from benchmarks.step_floor import bandwidth_bytes_per_s  # noqa: E402
from speculative.config import EngineConfig  # noqa: E402
from workers.build import weight_bytes  # noqa: E402
from workers.layers import fp8  # noqa: E402

SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}  # fmt: skip  (N, K)
TOKENS = [6, 48, 192]  # verify rows x (K + 1) at batch 1, 8, 32


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def prefill_linear(x, w8, scale):
    with fp8.prefill_forward():  # activations quantized: _scaled_mm
        return fp8.fp8_linear(x, w8, scale)


def gemm_point(name: str, N: int, K: int, M: int, device, bandwidth: float) -> dict:
    g = torch.Generator(device=device).manual_seed(N + K + M)
    x = torch.randn(M, K, device=device, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=device, generator=g) * 0.02).to(torch.bfloat16)
    w8, scale = fp8.quantize_rows(w)
    x8, x_scale = fp8.quantize_per_token(x)
    exact = (x8.float() * x_scale) @ (w8.float() * scale[:, None]).t()
    widened = fp8.widened_product(x8, x_scale, w8, scale, torch.bfloat16)
    row = {"shape": name, "N": N, "K": K, "M": M, "widened_rel_err": relative(widened, exact),
           "fp8_vs_bf16_rel_err": relative(prefill_linear(x, w8, scale), F.linear(x, w)),
           "uses_scaled_mm": fp8.uses_scaled_mm(x, w8)}  # fmt: skip
    try:
        scaled = fp8.scaled_mm_product(x8, x_scale, w8, scale, torch.bfloat16)
    except RuntimeError as e:  # CPU builds without it, or a shape it refuses
        row["scaled_mm_error"] = str(e).splitlines()[0]
        return row
    row |= {"scaled_mm_rel_err": relative(scaled, exact),
            "scaled_mm_vs_widened_rel_err": relative(scaled, widened),
            "scaled_mm_us": 1000 * rb.time_ms(lambda: prefill_linear(x, w8, scale), device, 20),
            "bf16_us": 1000 * rb.time_ms(lambda: F.linear(x, w), device, 20),
            "fp8_read_floor_us": 1e6 * N * K / bandwidth,
            "bf16_read_floor_us": 2e6 * N * K / bandwidth}  # fmt: skip
    return row


def graph_replay_error(device) -> float | None:
    """fp8_linear captured in a CUDA graph, replayed on new inputs, against eager."""
    if device.type != "cuda":
        return None
    w8, scale = fp8.quantize_rows(torch.randn(4096, 4096, device=device) * 0.02)
    x = torch.randn(6, 4096, device=device, dtype=torch.bfloat16)
    fp8.fp8_linear(x, w8, scale)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8.fp8_linear(x, w8, scale)
    x.copy_(torch.randn_like(x))
    graph.replay()
    return relative(out, fp8.fp8_linear(x, w8, scale))


def gemm(args, device) -> dict:
    shapes = {"tiny": (64, 64)} if args.tiny else SHAPES_8B
    tokens = [1, 6] if args.tiny else TOKENS
    bandwidth = bandwidth_bytes_per_s(device)
    rows = [gemm_point(n, N, K, M, device, bandwidth)
            for n, (N, K) in shapes.items() for M in tokens]  # fmt: skip
    return {"rows": rows, "graph_replay_rel_err": graph_replay_error(device),
            "bandwidth_tb_s": bandwidth / 1e12}  # fmt: skip


def capacity(args, device) -> dict:
    """Each combination's runner as the engine sizes its pool (no kv_cache_memory_gb)."""
    rb.register_shapes()
    model = "random:tiny-llama" if args.tiny else "random:hf-llama-3.1-8b"
    rows = []
    for quantization, kv_dtype in ((None, "auto"), (None, "fp8"), ("fp8", "fp8")):
        cfg = EngineConfig(model=model, drafter="none", max_batch_size=32, max_model_len=8192,
                           gpu_memory_utilization=0.9, device=args.device,
                           quantization=quantization, kv_cache_dtype=kv_dtype)  # fmt: skip
        runner = rb.build_runner(cfg, graphs=False)
        kv = runner.kv
        rows.append({"weights": quantization or str(runner.dtype).removeprefix("torch."),
                     "kv_cache_dtype": kv_dtype,
                     "weights_gib": weight_bytes(runner.target) / 2**30,
                     "kv_bytes_per_token": kv.bytes_per_token,
                     "kv_tokens": kv.num_blocks * kv.block_size,
                     "sized_by": kv.sized_by})  # fmt: skip
        print(rows[-1], flush=True)
        del runner, kv
        rb.free_memory()
    return {"model": model, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("parts", nargs="+", choices=["gemm", "kernel", "capacity", "summary"])
    p.add_argument("--tiny", action="store_true", help="CPU dry run: tiny shapes")
    p.add_argument("--device", default="auto")
    p.add_argument("-o", "--output", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args()
    device = rb.pick_device(args.device)
    from benchmarks.gpu import fp8_kernel_check, fp8_summary

    parts = {"gemm": gemm, "kernel": fp8_kernel_check.run, "capacity": capacity,
             "summary": fp8_summary.run}  # fmt: skip
    for part in args.parts:
        with torch.inference_mode():
            out = parts[part](args, device) | {"device": rb.device_name(device)}
        path = args.output / f"fp8_{part}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"== {part}: wrote {path}")
        print_part(part, out)


def print_part(part: str, out: dict) -> None:
    if part == "gemm":
        print("shape      M  scaled_mm err  widened err  fp8 vs bf16   us fp8  us bf16  floor fp8")
        for r in out["rows"]:
            keys = ("scaled_mm_rel_err", "scaled_mm_us", "bf16_us", "fp8_read_floor_us")
            nan = {k: r.get(k, float("nan")) for k in keys}  # absent where _scaled_mm failed
            print(f"{r['shape']:>8} {r['M']:>4} {nan['scaled_mm_rel_err']:>14.2e} "
                  f"{r['widened_rel_err']:>12.2e} {r['fp8_vs_bf16_rel_err']:>12.2e} "
                  f"{nan['scaled_mm_us']:>8.1f} {nan['bf16_us']:>8.1f} "
                  f"{nan['fp8_read_floor_us']:>10.1f}")  # fmt: skip
        print(f"CUDA graph replay vs eager: {out['graph_replay_rel_err']}")
    elif part == "capacity":
        for r in out["rows"]:
            print(f"weights {r['weights']:>8} ({r['weights_gib']:.2f} GiB), KV "
                  f"{r['kv_cache_dtype']:>4}: {r['kv_bytes_per_token']} bytes a token, "
                  f"{r['kv_tokens']} tokens")  # fmt: skip
    elif "table" in out:
        print("\n".join(out["table"]))


if __name__ == "__main__":
    main()
