"""Control-plane cost of the Ray path on CPU (issue 4): per step, the plan out (serialise + ZMQ
send) and the result back (ZMQ round trip beyond the worker's own execute time), against the step
time; and the fraction of wall time the coordinator waits on workers, with and without overlap.
Prints a table, writes JSON."""

import argparse
import json
import os

import ray

from deployments.bench import load_prompts, run_load
from speculative.config import EngineConfig, SamplingParams
from speculative.engine.coordinator import Coordinator
from speculative.engine.llm_engine import encode_prompt


def measure(cfg: EngineConfig, prompts, params, concurrency: int) -> list[dict]:
    coordinator = Coordinator(cfg)
    rows = []
    try:
        run_load(coordinator, prompts[:2], params, 2)  # warm-up
        for overlap in (False, True):
            coordinator.engine.overlap = overlap
            before = coordinator.stats()
            load = run_load(coordinator, prompts, params, concurrency)
            after = coordinator.stats()
            d = {
                k: after[k] - before[k]
                for k in ("num_steps", "send_s", "wait_s", "busy_s", "worker_execute_s")
            }
            steps = d["num_steps"]
            rows.append(
                {
                    "tp": cfg.tp,
                    "drafter": cfg.drafter,
                    "overlap": overlap,
                    "steps": steps,
                    "plan_out_ms": 1000 * d["send_s"] / steps,
                    "result_back_ms": 1000 * max(d["wait_s"] - d["worker_execute_s"], 0) / steps
                    if not overlap
                    else None,
                    "step_ms": 1000 * d["busy_s"] / steps,
                    "worker_execute_ms": 1000 * d["worker_execute_s"] / steps,
                    "coordinator_wait_fraction": d["wait_s"] / d["busy_s"],
                    "output_tokens_per_s": load["output_tokens_per_s"],
                }
            )
    finally:
        coordinator.shutdown()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", default="1,3")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("-o", "--output", default="benchmarks/control_plane.json")
    args = p.parse_args()
    ray.init(num_cpus=max(os.cpu_count() or 1, 4), logging_level="ERROR", log_to_driver=False)
    from workers.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    prompts = [encode_prompt(tokenizer, q) for q in load_prompts(None, args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for tp in (int(t) for t in args.tp.split(",")):
        for drafter in ("none", "default"):
            rows += measure(
                EngineConfig(drafter=drafter, tp=tp, max_batch_size=4, max_model_len=1024),
                prompts,
                params,
                4,
            )
    ray.shutdown()
    print(
        f"{'tp':>2} {'drafter':8} {'overlap':>7} {'plan out':>9} {'result back':>11} {'step':>8} "
        f"{'worker':>8} {'wait frac':>9} {'tok/s':>6}"
    )
    for r in rows:
        back = f"{r['result_back_ms']:.3f}ms" if r["result_back_ms"] is not None else "-"
        print(
            f"{r['tp']:>2} {r['drafter']:8} {str(r['overlap']):>7} {r['plan_out_ms']:>7.3f}ms "
            f"{back:>11} "
            f"{r['step_ms']:>6.1f}ms {r['worker_execute_ms']:>6.1f}ms "
            f"{r['coordinator_wait_fraction']:>9.1%} "
            f"{r['output_tokens_per_s']:>6.1f}"
        )
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
