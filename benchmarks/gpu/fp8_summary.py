"""The step_floor.py runs of benchmarks/gpu/fp8_gpu_job.sh side by side (fp8_checks.py's
`summary` part): the verify pass in bf16 and FP8 against FP8's weight-read floor, and plain
decoding's tokens a second (batch x steps a second: one token a row a step) in each."""

import json
from pathlib import Path

GOAL = 1.3  # FP8 verify at batch 1, 1k over FP8's floor


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"step_floor_{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def paired_rows(bf16: dict, fp8: dict) -> list[tuple[dict, dict]]:
    """The (bf16 row, FP8 row) pairs of the batch and context points both runs measured."""
    fp8_rows = {(r["batch"], r["context"]): r for r in fp8["rows"]}
    pairs = [(r, fp8_rows.get((r["batch"], r["context"]))) for r in bf16["rows"]]
    return [(r, f) for r, f in pairs if f is not None]


def verify_rows(bf16: dict, fp8: dict) -> tuple[list[str], list[dict]]:
    floor = fp8["floors"]["verify_floor_ms"]
    lines = [f"FP8 weight-read floor of the verify pass: {floor:.2f} ms (bf16's: "
             f"{bf16['floors']['verify_floor_ms']:.2f} ms)",
             "batch context  bf16 ms  x fp8 floor   fp8 ms  x fp8 floor  bf16/fp8"]  # fmt: skip
    rows = []
    for r, f in paired_rows(bf16, fp8):
        rows.append({"batch": r["batch"], "context": r["context"], "bf16_verify_ms": r["verify_ms"],
                     "fp8_verify_ms": f["verify_ms"], "fp8_floor_ms": floor,
                     "bf16_over_fp8_floor": r["verify_ms"] / floor,
                     "fp8_over_fp8_floor": f["verify_ms"] / floor})  # fmt: skip
        x = rows[-1]
        lines.append(f"{x['batch']:>5} {x['context']:>7} {x['bf16_verify_ms']:>8.2f} "
                     f"{x['bf16_over_fp8_floor']:>11.2f}x {x['fp8_verify_ms']:>8.2f} "
                     f"{x['fp8_over_fp8_floor']:>10.2f}x "
                     f"{x['bf16_verify_ms'] / x['fp8_verify_ms']:>8.2f}")  # fmt: skip
    goal = next((x for x in rows if x["batch"] == 1 and x["context"] == 1024), None)
    if goal is not None:
        met = "met" if goal["fp8_over_fp8_floor"] <= GOAL else "not met"
        lines.append(f"goal: FP8 verify at batch 1, 1k is {goal['fp8_over_fp8_floor']:.2f}x "
                     f"FP8's floor ({met}; goal {GOAL}x)")  # fmt: skip
    return lines, rows


def plain_rows(bf16: dict, fp8: dict) -> tuple[list[str], list[dict]]:
    lines = ["plain decoding: batch context  bf16 tok/s  fp8 tok/s  fp8/bf16"]
    rows = []
    for r, f in paired_rows(bf16, fp8):
        b, c = r["batch"], r["context"]
        rows.append({"batch": b, "context": c, "bf16_tokens_per_s": 1000 * b / r["step_ms"],
                     "fp8_tokens_per_s": 1000 * b / f["step_ms"]})  # fmt: skip
        x = rows[-1]
        lines.append(f"{b:>20} {c:>7} {x['bf16_tokens_per_s']:>11.0f} "
                     f"{x['fp8_tokens_per_s']:>10.0f} "
                     f"{x['fp8_tokens_per_s'] / x['bf16_tokens_per_s']:>9.2f}")  # fmt: skip
    return lines, rows


def run(args, device) -> dict:
    out, table = {}, []
    for kind, rows_of in (("", verify_rows), ("plain_", plain_rows)):
        bf16, fp8 = load(args.output, kind + "bf16"), load(args.output, kind + "fp8")
        if bf16 is None or fp8 is None:
            table.append(f"no step_floor_{kind}bf16.json and step_floor_{kind}fp8.json pair")
            continue
        lines, out[kind + "rows"] = rows_of(bf16, fp8)
        table += lines
    out["table"] = table
    return out
