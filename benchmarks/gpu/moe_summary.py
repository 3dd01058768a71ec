"""The verify pass of a MoE target at K = 1..5 against its plain decode step, per batch, from
moe_job.sh's step_floor JSON files (moe_plain_bf16.json, moe_verify_k<K>.json): the table that
says whether auto K's measured costs should differ for MoE (a verify of K + 1 tokens a row routes
to more experts than one token does). Prints a table, writes moe_summary.json beside them.

    python3 benchmarks/gpu/moe_summary.py OUT_DIR
"""

import json
import sys
from pathlib import Path


def rows(path: Path) -> dict:
    if not path.is_file():
        return {}
    return {r["batch"]: r for r in json.loads(path.read_text())["rows"] if r["context"] <= 1024}


def main() -> None:
    out = Path(sys.argv[1])
    plain = rows(out / "moe_plain_bf16.json")
    table = []
    for k in range(1, 6):
        for batch, r in rows(out / f"moe_verify_k{k}.json").items():
            if batch in plain:
                base = plain[batch]
                table.append({"k": k, "batch": batch, "plain_ms": base["verify_ms"],
                              "verify_ms": r["verify_ms"],
                              "verify_over_plain": r["verify_ms"] / base["verify_ms"],
                              "experts_gib_plain": base["experts_read_gib"],
                              "experts_gib_verify": r["experts_read_gib"]})  # fmt: skip
    print(f"{'K':>2} {'batch':>5} {'plain ms':>9} {'verify ms':>9} {'x plain':>8} "
          f"{'experts GiB plain':>17} {'verify':>7}")  # fmt: skip
    for t in table:
        print(f"{t['k']:>2} {t['batch']:>5} {t['plain_ms']:>9.2f} {t['verify_ms']:>9.2f} "
              f"{t['verify_over_plain']:>7.2f}x {t['experts_gib_plain']:>17.3f} "
              f"{t['experts_gib_verify']:>7.3f}")  # fmt: skip
    (out / "moe_summary.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
