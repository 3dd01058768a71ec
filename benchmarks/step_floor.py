"""Per-step time of verify and drafting on a Llama-3.1-8B-shaped target + drafter with random
weights, against the floor of reading the target's weights once per step (bytes / measured
bandwidth). Also reports the GPU memory of each part. Prints a table, writes JSON."""

import argparse
import json

import torch

from speculative.config import EngineConfig, SamplingParams
from speculative.plan import PrefillRow, StepPlan
from workers.model_runner import ModelRunner


def bandwidth_bytes_per_s() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1000)  # read + write


def timed(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def memory_report(runner: ModelRunner) -> dict:
    weights = sum(p.numel() * p.element_size() for p in runner.target.parameters())
    drafter = (
        sum(
            p.numel() * p.element_size()
            for n, p in runner.drafter.named_parameters()
            if not n.startswith("embed_tokens")
        )
        if runner.drafter
        else 0
    )
    kv = runner.kv.target.nbytes + (
        runner.kv.drafter.nbytes if runner.kv.drafter is not None else 0
    )
    return {
        "target_weights_mib": weights / 2**20,
        "drafter_weights_mib": drafter / 2**20,
        "kv_cache_mib": kv / 2**20,
        "resource_manager_mib": runner.resources.nbytes / 2**20,
        "cuda_graph_pool_mib": runner.graphs.pool_bytes / 2**20,
    }


@torch.inference_mode()
def prompt_ids(slot: int, length: int) -> list[int]:
    return [1 + (slot * 7 + i) % 1000 for i in range(length)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--drafter", default="random")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("-o", "--output", default="benchmarks/step_floor.json")
    args = p.parse_args()
    runner = ModelRunner(
        EngineConfig(
            model=args.model,
            drafter=args.drafter,
            num_draft_tokens=args.k,
            max_batch_size=32,
            max_model_len=256,
            device="cuda",
        )
    )
    bw = bandwidth_bytes_per_s()
    weight_bytes = sum(
        t.numel() * t.element_size()
        for t in {id(p): p for p in runner.target.parameters()}.values()
    )
    floor_ms = weight_bytes / bw * 1000
    rows = []
    for B in (1, 8, 32):
        used = list(range(B))
        runner.execute(
            StepPlan(
                step_id=0,
                free_slots=[s for s in used if runner.resources.is_allocated[s]],
                prefills=[
                    PrefillRow(s, prompt_ids(s, args.prompt_len), s, SamplingParams()) for s in used
                ],
                kv_len=512,
            )
        ).result()
        slots = torch.arange(B, device="cuda")
        plan = StepPlan(step_id=1, decode_slots=used, kv_len=256)

        def rewind(B=B):  # keep every timed step's positions inside the 256-row context
            runner.state.num_computed[:B] = args.prompt_len

        rewind()
        verify = timed(lambda slots=slots: runner.graphs.verify(slots, kv_len=256))
        rewind()
        step = timed(lambda plan=plan: runner.execute(plan).result(), repeats=10)
        rewind()
        positions = slots + args.prompt_len
        chain = (
            timed(lambda s=slots, p=positions: runner.graphs.chain(s, s, p, kv_len=256))
            if runner.graphs.chain
            else 0.0
        )
        rows.append(
            {
                "batch": B,
                "verify_ms": verify,
                "draft_steps_2_to_k_ms": chain,
                "full_step_ms": step,
                "first_draft_and_rest_ms": step - verify - chain,
                "weight_read_floor_ms": floor_ms,
                "step_over_floor": step / floor_ms,
            }
        )
    print(
        f"{args.model}: weights {weight_bytes / 2**30:.2f} GiB, bandwidth {bw / 1e12:.2f} TB/s, "
        f"floor {floor_ms:.2f} ms"
    )
    print(
        f"{'batch':>5} {'verify':>8} {'draft 2..K':>10} {'rest':>8} {'step':>8} {'floor':>7} "
        f"{'x floor':>7}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['verify_ms']:>7.2f}m {r['draft_steps_2_to_k_ms']:>9.2f}m "
            f"{r['first_draft_and_rest_ms']:>7.2f}m {r['full_step_ms']:>7.2f}m {floor_ms:>6.2f}m "
            f"{r['step_over_floor']:>6.2f}x"
        )
    out = {
        "model": args.model,
        "k": args.k,
        "bandwidth_tb_s": bw / 1e12,
        "weight_gib": weight_bytes / 2**30,
        "memory": memory_report(runner),
        "rows": rows,
    }
    print(json.dumps(out["memory"]))
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
