"""Where a step's time goes on the Ray path: every step's timeline (coordinator sends the plan,
rank 0 receives it, finishes launching, has the results on the host; the coordinator gets them),
for plain and EAGLE-3 with overlap on and off. Answers "why is overlap not faster" with numbers.
Prints a table per configuration, writes the summaries and the raw timelines as JSON."""

import argparse
import json
from itertools import pairwise

import numpy as np

from deployments.bench import load_prompts, run_load
from speculative.config import EngineConfig, SamplingParams


def summarise(trace: list[dict], wall_s: float) -> dict:
    def ms(values):
        return float(np.mean(values) * 1000) if values else None

    out = {"num_steps": len(trace), "steps_per_s": len(trace) / wall_s}
    for kind, rows in (
        ("prefill", [t for t in trace if t["num_prefills"]]),
        ("decode", [t for t in trace if not t["num_prefills"]]),
    ):
        out[kind] = {
            "num": len(rows),
            "plan_to_worker_ms": ms([t["received_at"] - t["sent_at"] for t in rows]),
            "launch_ms": ms([t["launched_at"] - t["received_at"] for t in rows]),
            "launch_to_ready_ms": ms([t["ready_at"] - t["launched_at"] for t in rows]),
            "device_ms": ms([t["device_s"] for t in rows]),
            "ready_to_coordinator_ms": ms([max(t["got_at"] - t["ready_at"], 0) for t in rows]),
        }
    ordered = sorted(trace, key=lambda t: t["step_id"])
    # host time between a result arriving and the next plan leaving (the scheduler's own work)
    gaps = [b["sent_at"] - a["got_at"] for a, b in pairwise(ordered) if b["sent_at"] > a["got_at"]]
    out["coordinator_gap_ms"] = ms(gaps)
    # the worker idles between finishing one launch and receiving the next plan
    idle = [max(b["received_at"] - a["launched_at"], 0) for a, b in pairwise(ordered)]
    out["worker_idle_ms"] = ms(idle)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("--dataset")
    p.add_argument("--batch", default="1,8")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("-o", "--output", default="benchmarks/step_trace.json")
    args = p.parse_args()
    import ray

    from speculative.engine.coordinator import Coordinator
    from speculative.engine.llm_engine import encode_prompt

    ray.init(include_dashboard=False, num_cpus=4, log_to_driver=False)
    batches = [int(b) for b in args.batch.split(",")]
    results = []
    for drafter in ("none", args.drafter):
        cfg = EngineConfig(
            model=args.model,
            drafter=drafter,
            num_draft_tokens=args.k,
            max_batch_size=max(batches),
            max_model_len=1024,
            device=args.device,
        )
        coordinator = Coordinator(cfg)
        prompts = [encode_prompt(coordinator.tokenizer, q) for q in load_prompts(args.dataset, 64)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        try:
            run_load(coordinator, prompts[:2], params, 2)  # warm-up
            for batch in batches:
                for overlap in (True, False):
                    coordinator.engine.overlap = overlap
                    coordinator.executor.trace = []
                    load = run_load(coordinator, prompts[: 2 * batch], params, batch)
                    trace, coordinator.executor.trace = coordinator.executor.trace, None
                    summary = summarise(trace, load["wall_s"])
                    results.append(
                        {
                            "mode": "plain" if drafter == "none" else "eagle",
                            "batch": batch,
                            "overlap": overlap,
                            "tokens_per_s": load["output_tokens_per_s"],
                            "ttft_p50_ms": load["ttft_ms"]["p50"],
                            **summary,
                            "trace": trace,
                        }
                    )
                    print_row(results[-1])
        finally:
            coordinator.shutdown()
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {args.output}")


def print_row(r: dict) -> None:
    def f(x):
        return "-" if x is None else f"{x:6.2f}"

    print(
        f"{r['mode']:5} b={r['batch']:<3} overlap={str(r['overlap']):5} {r['tokens_per_s']:8.1f} "
        "tok/s  "
        f"ttft {r['ttft_p50_ms']:6.1f} ms  steps/s {r['steps_per_s']:7.1f}  gap "
        f"{f(r['coordinator_gap_ms'])}  "
        f"idle {f(r['worker_idle_ms'])}"
    )
    for kind in ("prefill", "decode"):
        k = r[kind]
        if k["num"]:
            print(
                f"    {kind:7} n={k['num']:<4} to-worker {f(k['plan_to_worker_ms'])} launch "
                f"{f(k['launch_ms'])} "
                f"launch->ready {f(k['launch_to_ready_ms'])} device {f(k['device_ms'])} "
                f"ready->coord {f(k['ready_to_coordinator_ms'])}"
            )


if __name__ == "__main__":
    main()
