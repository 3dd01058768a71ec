"""The verify pass and the whole speculative step against the floor of reading the weights once,
on the paged engine: a Llama-3.1-8B-shaped target with random weights and a random EAGLE-3 head
shaped like yuhuili's (one layer, a 32000-token draft vocabulary), bf16, K=5, CUDA graphs, at
batch 1, 8, 32 and contexts 1k, 8k, 32k where their KV fits in --kv-gib (32 x 32k does not: 132
GiB). The floor is the bytes a forward reads (the target's weights but its embedding table) over
the measured copy bandwidth; the step's floor adds K drafter forwards. Prints a table, writes
JSON (default $OUT/step_floor.json). The issue's goal: verify at batch 1, 1k within 1.3x.
`--quantization fp8` runs the target's linear layers in FP8 (the floor is then FP8's bytes),
`--kv-cache-dtype fp8` the KV cache.

    python3 benchmarks/step_floor.py                     # on a GPU (about 1-2 minutes)
    python3 benchmarks/step_floor.py --tiny              # CPU dry run, a tiny model
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import runner_bench as rb  # noqa: E402
from benchmarks.kernel_profile import print_profile, profile_step  # noqa: E402
from speculative.config import EngineConfig  # noqa: E402
from speculative.plan import StepPlan  # noqa: E402
from workers.cuda_graphs import GraphInput, StepGraphs, StepGraphSet  # noqa: E402
from workers.cuda_graphs import _capture_in_one_pool as capture_in_one_pool  # noqa: E402
from workers.device import pick_device, pick_dtype  # noqa: E402
from workers.layers.moe import Experts  # noqa: E402

GOAL = 1.3  # verify at batch 1, 1k context, over the floor


def bandwidth_bytes_per_s(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty((2 << 30) if device.type == "cuda" else (64 << 20), dtype=torch.uint8,
                    device=device)  # fmt: skip
    y = torch.empty_like(x)
    ms = rb.time_ms(lambda: y.copy_(x), device, repeats=10)
    return 2 * x.numel() / (ms / 1000)


def read_bytes(model: torch.nn.Module, embedding_read: bool = False) -> int:
    """Bytes of the weights a forward reads: all but the embedding table (a few rows of it),
    unless it is the LM head too (tied), and but the experts (touched_expert_bytes)."""
    tensors = {
        p.data_ptr(): p.nbytes
        for n, p in model.named_parameters()
        if (embedding_read or not n.startswith("embed_tokens.")) and ".experts." not in n
    }
    return sum(tensors.values())


def touched_expert_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the experts one call of `run` routes its tokens to: in each MoE layer, the gate,
    up and down rows of every expert chosen, read once (0 for a dense model)."""
    touched = []

    def record(module, inputs, output):  # Experts.forward(x, route_weights, topk_ids)
        per_expert = sum(w.weight[0].nbytes for w in (module.gate_up, module.down))
        touched.append(int(inputs[2].unique().numel()) * per_expert)

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, Experts)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(touched)


def capture_point(runner, batch: int, context: int) -> StepGraphSet:
    """The engine's verify and draft-chain graphs, for this batch and context only (capturing
    every bucket of an 8B target would take minutes). CPU: none, the eager path runs."""
    if runner.device.type != "cuda":
        return StepGraphSet()
    return point_graphs(runner, batch, context)


def point_graphs(runner, batch: int, context: int) -> StepGraphSet:
    graphs, dummy, dev = StepGraphSet(), runner.kv.dummy_slot, runner.device
    graphs.verify = StepGraphs(runner.verifier.greedy, batch, [context], dummy, [], dev)
    if runner.proposer is not None and runner.K > 1:
        inputs = [GraphInput(torch.long), GraphInput(torch.long)]
        chain = runner.proposer.draft_steps
        graphs.chain = StepGraphs(chain, batch, [context], dummy, inputs, dev)
    for g in graphs.all():
        g.batch_buckets = [batch]
    with torch.inference_mode():
        capture_in_one_pool(graphs.all())
    return graphs


@torch.inference_mode()
def measure_point(runner, batch: int, context: int, repeats: int, profile: bool) -> dict:
    """Verify pass alone, draft steps 2..K alone, and the whole step (execute), in ms; with
    `profile`, the verify pass kernel by kernel (benchmarks/kernel_profile.py)."""
    rb.place_rows(runner, batch, context)
    slots = rb.prefill(runner, batch, 16, runner.target_cfg.vocab_size)
    runner.graphs = capture_point(runner, batch, context)
    verify = runner.graphs.verify or runner.verifier.greedy
    chain = runner.graphs.chain or (runner.proposer.draft_steps if runner.K > 1 else None)
    index = torch.tensor(slots, device=runner.device)
    start = context - rb.margin(runner.K, repeats)
    row = {"batch": batch, "context": context}
    rb.rewind(runner, batch, start)
    greedy = runner.verifier.greedy  # eager: its MoE layers' routing is seen
    row["experts_read_gib"] = (
        touched_expert_bytes(runner.target, lambda: greedy(index, kv_len=context)) / 2**30
    )
    rb.rewind(runner, batch, start)
    row["verify_ms"] = rb.time_ms(lambda: verify(index, kv_len=context), runner.device, repeats)
    if profile:
        rb.rewind(runner, batch, start)
        row["profile"] = profile_step(lambda: verify(index, kv_len=context), runner.device)
    positions, row["draft_steps_2_to_k_ms"] = torch.full_like(index, start), 0.0
    if chain is not None:  # K > 1
        row["draft_steps_2_to_k_ms"] = rb.time_ms(
            lambda: chain(index, index, positions, kv_len=context), runner.device, repeats
        )
    plan, host_s = StepPlan(step_id=1, decode_slots=slots, kv_len=context), []
    rb.rewind(runner, batch, start)
    row["step_ms"] = rb.time_ms(
        lambda: host_s.append(runner.execute(plan).execute_s), runner.device, repeats
    )
    row["step_host_ms"] = 1000 * sum(host_s[-repeats:]) / repeats
    rb.release(runner, slots)
    runner.graphs = StepGraphSet()
    return row


def grid(args, per_token: int, max_positions: int) -> tuple[list, list]:
    """(batch, context) points whose KV (with the timing margin) fits in --kv-gib and whose
    context the model's positions hold; the others."""
    fits, skipped = [], []
    for context in args.context:
        for batch in args.batch:
            gib = batch * (context + 16) * per_token / 2**30
            ok = gib <= args.kv_gib and context + 64 <= max_positions
            (fits if ok else skipped).append((batch, context, round(gib, 1)))
    if not fits:
        raise SystemExit(f"no point fits in --kv-gib {args.kv_gib}")
    return fits, skipped


def make_runner(args, fits: list, per_token: int):
    pool_gib = max(b * (c + 16) for b, c, _ in fits) * per_token / 2**30 + 0.01
    cfg = EngineConfig(
        model=args.model, drafter=args.drafter, num_draft_tokens=args.k,
        max_batch_size=max(b for b, _, _ in fits), max_model_len=max(c for _, c, _ in fits) + 64,
        kv_cache_memory_gb=pool_gib, device=args.device, dtype=args.dtype, cuda_graphs=False,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    return rb.build_runner(cfg, graphs=False, draft_vocab_size=args.draft_vocab)


def floors(runner, bandwidth: float) -> dict:
    """The step reads the target once, the drafter K times, its `fc` once (the first draft's)."""
    target = read_bytes(runner.target, runner.target_cfg.tie_word_embeddings)
    drafter = fc = 0
    if runner.drafter is not None:
        drafter, fc = read_bytes(runner.drafter), runner.drafter.fc.weight.nbytes
    step = target + fc + runner.K * (drafter - fc)
    everything = sum(p.nbytes for p in runner.target.parameters())
    return {
        "target_read_gib": target / 2**30,
        "drafter_read_gib": drafter / 2**30,
        "verify_floor_ms": target / bandwidth * 1000,
        "step_floor_ms": step / bandwidth * 1000,
        # the earlier figure's floor (DESIGN.md: 3.76 ms on the H200) counted every weight
        "all_target_weights_floor_ms": everything / bandwidth * 1000,
    }


def memory_gib(runner) -> dict:
    drafter = read_bytes(runner.drafter) if runner.drafter is not None else 0
    return {"target_weights": sum(p.nbytes for p in runner.target.parameters()) / 2**30,
            "drafter_weights": drafter / 2**30, "kv_pool": runner.kv.nbytes / 2**30,
            "resource_manager": runner.resources.nbytes / 2**30}  # fmt: skip


def print_table(out: dict) -> None:
    f = out["floors"]
    print(f"{out['model']} (drafter {out['drafter']}, K={out['k']}, weights "
          f"{out['quantization'] or out['dtype']}, KV {out['kv_cache_dtype']}) on {out['device']}: "
          f"bandwidth {out['bandwidth_tb_s']:.2f} TB/s, target reads {f['target_read_gib']:.2f} "
          f"GiB: verify floor {f['verify_floor_ms']:.2f} ms, step floor "
          f"{f['step_floor_ms']:.2f} ms")  # fmt: skip
    print(f"{'batch':>5} {'context':>7} {'verify':>8} {'x floor':>7} {'draft2..K':>9} "
          f"{'step':>8} {'x floor':>7} {'host':>7}")  # fmt: skip
    for r in out["rows"]:
        cells = (f"{r['batch']:>5} {r['context']:>7} {r['verify_ms']:>8.2f}",
                 f"{r['verify_over_floor']:>6.2f}x {r['draft_steps_2_to_k_ms']:>9.2f}",
                 f"{r['step_ms']:>8.2f} {r['step_over_floor']:>6.2f}x",
                 f"{r['step_host_ms']:>7.2f}")  # fmt: skip
        print(" ".join(cells))
    for b, c, gib in out["skipped"]:
        print(f"skipped: batch {b} at {c} tokens ({gib} GiB of KV; --kv-gib {out['kv_gib']}, "
              f"positions {out['max_positions']})")  # fmt: skip
    if out.get("goal"):
        print(out["goal"])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="random:hf-llama-3.1-8b")
    p.add_argument("--drafter", default="random", help="random, or none for plain decoding")
    p.add_argument("--draft-vocab", type=int, default=32000, help="the random head's; 0: full")
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--kv-gib", type=float, default=60.0, help="the most KV the points may take")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", choices=["fp8"], default=None, help="the target's weights")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--profile", action="store_true", help="the verify pass kernel by kernel")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: a tiny model, small sizes")
    default_out = Path(os.environ.get("OUT", ".")) / "step_floor.json"
    p.add_argument("-o", "--output", type=Path, default=default_out)
    args = p.parse_args()
    if args.tiny:
        if not args.model.startswith("random:tiny-"):  # a tiny shape given is kept
            args.model = "random:tiny-llama"
        args.draft_vocab, args.repeats = 256, 2
        args.batch, args.context, args.kv_gib = [1, 2], [128, 256], 0.01
    return args


def goal_line(rows: list[dict]) -> str | None:
    row = next((r for r in rows if r["batch"] == 1 and r["context"] == 1024), None)
    if row is None:
        return None
    met = "met" if row["verify_over_floor"] <= GOAL else "not met"
    return f"goal: verify at batch 1, 1k is {row['verify_over_floor']:.2f}x the floor ({met})"


def main() -> None:
    args = parse_args()
    rb.register_shapes()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    model_cfg = rb.model_config(args.model)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    per_token = rb.kv_bytes_per_token(model_cfg, kv_dtype, args.drafter != "none")
    fits, skipped = grid(args, per_token, model_cfg.max_position_embeddings)
    bandwidth = bandwidth_bytes_per_s(device)
    rb.free_memory()
    runner = make_runner(args, fits, per_token)
    out = {"model": args.model, "drafter": args.drafter, "draft_vocab": args.draft_vocab,
           "k": runner.K, "dtype": str(dtype), "device": rb.device_name(device),
           "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
           "bandwidth_tb_s": bandwidth / 1e12, "kv_gib": args.kv_gib,
           "max_positions": model_cfg.max_position_embeddings,
           "kv_capacity": runner.kv.capacity(runner.max_model_len),
           "floors": floors(runner, bandwidth), "memory_gib": memory_gib(runner),
           "skipped": skipped, "rows": []}  # fmt: skip
    for batch, context, _ in rb.progress(fits, "points", "point"):
        row = measure_point(runner, batch, context, args.repeats, args.profile)
        rb.free_memory()  # this point's graphs
        experts_ms = row["experts_read_gib"] * 2**30 / bandwidth * 1000  # 0 for dense models
        row["verify_floor_ms"] = out["floors"]["verify_floor_ms"] + experts_ms
        row["step_floor_ms"] = out["floors"]["step_floor_ms"] + experts_ms
        row["verify_over_floor"] = row["verify_ms"] / row["verify_floor_ms"]
        if args.profile:
            title = f"verify pass, batch {batch}, context {context}"
            print_profile(title, row["profile"], 1000 * out["floors"]["verify_floor_ms"])
        row["step_over_floor"] = row["step_ms"] / row["step_floor_ms"]
        out["rows"].append(row)
        out["goal"], out["peak_memory_gib"] = goal_line(out["rows"]), rb.peak_memory_gib(device)
        args.output.write_text(json.dumps(out, indent=1) + "\n")  # a timeout keeps what ran
    print_table(out)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
