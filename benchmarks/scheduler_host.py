"""The scheduler's host time per step (plan + process of a step's results), without a model: how
much of a large-batch step the coordinator's own bookkeeping can explain. Synthetic results (plain:
one token a row; EAGLE-3: 1..K+1 tokens a row), greedy requests that never finish. Prints a table,
writes JSON."""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from speculative.config import SamplingParams  # noqa: E402
from speculative.engine.scheduler import Scheduler  # noqa: E402
from speculative.plan import StepResult  # noqa: E402


def time_steps(batch: int, k: int, num_steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    s = Scheduler(batch, 1 << 20, batch * 256, k, {2}, None, 0, vocab_size=49152)
    for i in range(batch):
        s.add(
            f"r{i}",
            rng.integers(100, 40000, 128).tolist(),
            SamplingParams(temperature=0.0, max_tokens=1 << 19),
        )
    tokens = rng.integers(100, 40000, (batch, k + 1))
    emitted = rng.integers(1, k + 2, batch)

    def step():
        plan = s.plan()
        rows = len(plan.prefills) + len(plan.decode_slots)
        s.process(plan, StepResult(plan.step_id, tokens[:rows], emitted[:rows]))
        return s.num_running + s.num_waiting  # what a driver loop reads every step

    for _ in range(10):
        step()
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    return (time.perf_counter() - start) / num_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 256])
    ap.add_argument("-k", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("-o", "--output", default="benchmarks/scheduler_host.json")
    args = ap.parse_args()
    rows = []
    print(f"{'batch':>6} {'K':>3} {'ms/step':>8} {'us/row':>7}")
    for batch in args.batch:
        for k in args.k:
            seconds = time_steps(batch, k, args.steps)
            rows.append(
                {
                    "batch": batch,
                    "k": k,
                    "ms_per_step": seconds * 1e3,
                    "us_per_row": seconds / batch * 1e6,
                }
            )
            print(f"{batch:>6} {k:>3} {seconds * 1e3:>8.2f} {seconds / batch * 1e6:>7.1f}")
    Path(args.output).write_text(json.dumps({"steps": args.steps, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
