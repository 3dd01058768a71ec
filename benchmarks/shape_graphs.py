"""Steps of every shape in CUDA graphs, and late grammar masks, against neither:
benchmarks/structured_speed.py run twice in turn, with the graphs of constrained, lowered-K and
mixed-K steps (workers/cuda_graphs.py: verify_by_width, draft_depth) and constrained rows in
every overlapped step (their masks late), and without both (EAGLESERVE_SHAPE_GRAPHS=0: those
steps eager; EAGLESERVE_LATE_GRAMMAR=0: a constrained row in every second step, as before).
Prints per batch and mix the constrained rows' tokens/s, new ("graphed") against old ("eager"),
and their ratio to free text's (the goal: >= 0.85 at batch 8, plain and speculative). Writes
both runs' JSON and a summary. Run on a GPU (the graphs are CUDA's):

    python3 benchmarks/shape_graphs.py --out-dir $OUT -- --device cuda --model M.gguf \
        --drafter speculative/drafters/smollm2-135m --batch 1,8,32 --max-tokens 128
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIXES = ("json_schema", "tool_call", "mixed")


def run(setting: str, args: list[str], out: Path) -> dict:
    env = os.environ | {"EAGLESERVE_SHAPE_GRAPHS": setting, "EAGLESERVE_LATE_GRAMMAR": setting}
    command = [sys.executable, "benchmarks/structured_speed.py", *args, "--out", str(out)]
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def summarize(on: dict, off: dict) -> list[dict]:
    rows = []
    for batch in on["batches"]:
        for mix in MIXES:
            for variant in ("plain", "spec"):
                key = f"{batch}/{mix}/{variant}"
                if key not in on:
                    continue
                free = on[f"{batch}/free/{variant}"]["free"]["tokens_per_s"]
                graphed = on[key]["constrained"]["tokens_per_s"]
                eager = off[key]["constrained"]["tokens_per_s"]
                spec = on[key]
                rows.append({"batch": batch, "mix": mix, "variant": variant,
                             "graphed_tokens_per_s": graphed, "eager_tokens_per_s": eager,
                             "graphed_vs_eager": graphed / eager, "vs_free_text": graphed / free,
                             "eager_vs_free_text": eager / free,
                             "tokens_per_step": spec["constrained"]["tokens_per_step"],
                             "draft_host_ms_per_step": spec["draft_host_ms_per_step"]})  # fmt: skip
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'batch/mix':18} {'variant':7} {'graphed':>8} {'eager':>8} {'ratio':>6} "
          f"{'vs free':>8} {'eager vs free':>13} {'tok/step':>8} {'host ms':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']}/{r['mix']:15} {r['variant']:7} {r['graphed_tokens_per_s']:8.1f} "
              f"{r['eager_tokens_per_s']:8.1f} {r['graphed_vs_eager']:6.2f} "
              f"{r['vs_free_text']:8.2f} {r['eager_vs_free_text']:13.2f} "
              f"{r['tokens_per_step']:8.2f} {r['draft_host_ms_per_step']:7.2f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks"))
    ap.add_argument("bench_args", nargs="*", help="structured_speed.py's, after --")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    on = run("1", args.bench_args, args.out_dir / "shape_graphs_on.json")
    off = run("0", args.bench_args, args.out_dir / "shape_graphs_off.json")
    rows = summarize(on, off)
    print_table(rows)
    summary = {"device": on["device"], "rows": rows}
    (args.out_dir / "shape_graphs.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
