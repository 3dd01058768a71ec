"""`num_draft_tokens: auto` against fixed K: one `eagleserve bench` run of plain decoding, K = 1,
3, 5 and auto at each batch size (GSM8K test prompts, greedy), then a table of tokens/s and
tokens per request per step, auto's ratio to the best fixed K and to K=5, and the K it chose.
The issue's goal: auto within 3% of the best fixed K at every batch, ahead of K=5 where K=5 is
not the best. Writes the bench JSON and a summary JSON.

    python benchmarks/auto_k.py [--device cpu] [--batch 1,8,32] [--output-len 64] \
        [--model M --drafter D --dataset F] [-o benchmarks/auto_k.json]
    python benchmarks/auto_k.py --summarize BENCH_JSON [-o SUMMARY_JSON]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

FIXED = [1, 3, 5]


def run_bench(args, bench_json: Path) -> None:
    command = [
        sys.executable, "-m", "deployments.cli", "bench", "--modes", "plain,eagle",
        "-k", ",".join(map(str, FIXED)) + ",auto", "--batch", args.batch,
        "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--device", args.device, "-o", str(bench_json),
    ]  # fmt: skip
    for flag in ("model", "drafter", "dataset"):
        if getattr(args, flag):
            command += [f"--{flag}", getattr(args, flag)]
    subprocess.run(command, check=True)


def summarize(runs: list[dict]) -> list[dict]:
    """A row per batch size: each K's tokens/s and tokens/step, auto's ratios and mean K."""
    rows = []
    for batch in sorted({r["batch"] for r in runs}):
        at = {r["k"] if r["mode"] == "eagle" else "plain": r for r in runs if r["batch"] == batch}
        speed = {k: r["output_tokens_per_s"] for k, r in at.items()}
        best = max(FIXED, key=lambda k: speed[k])
        steps = at["auto"]["auto_steps_by_k"]
        rows.append(
            {
                "batch": batch,
                "tokens_per_s": speed,
                "tokens_per_step": {k: r["tokens_per_step"] for k, r in at.items()},
                "best_fixed_k": best,
                "auto_vs_best": speed["auto"] / speed[best],
                "auto_vs_k5": speed["auto"] / speed[5],
                "auto_vs_plain": speed["auto"] / speed["plain"],
                "auto_mean_k": sum(k * n for k, n in enumerate(steps)) / max(1, sum(steps)),
                "auto_steps_by_k": steps,
                "meets_goal": speed["auto"] >= 0.97 * speed[best]
                and (best == 5 or speed["auto"] > speed[5]),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    names = ["plain", *FIXED, "auto"]
    print("batch " + " ".join(f"{f'K={k} tok/s':>12}" for k in names) + "  auto/best auto/K5 meanK")
    for r in rows:
        cells = " ".join(f"{r['tokens_per_s'][k]:12.1f}" for k in names)
        print(
            f"{r['batch']:5} {cells}  {r['auto_vs_best']:9.3f} {r['auto_vs_k5']:7.3f}"
            f" {r['auto_mean_k']:5.2f}"
        )
    print("tokens per request per step:")
    for r in rows:
        print(f"{r['batch']:5} " + " ".join(f"{r['tokens_per_step'][k]:12.2f}" for k in names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--dataset")
    p.add_argument("--summarize", type=Path, help="summarize this bench JSON instead of running")
    p.add_argument("-o", "--output", type=Path, default=Path("benchmarks/auto_k.json"))
    args = p.parse_args()
    bench_json = args.summarize or args.output.with_name(args.output.stem + "_bench.json")
    if args.summarize is None:
        run_bench(args, bench_json)
    rows = summarize(json.loads(bench_json.read_text())["runs"])
    print_table(rows)
    args.output.write_text(json.dumps({"bench": str(bench_json), "rows": rows}, indent=1))
    print(f"summary: {args.output}")


if __name__ == "__main__":
    main()
