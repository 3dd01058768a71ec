"""Run one benchmark command in a checkout of a base commit and in this tree, alternately, and
print their JSON results side by side (a refactor's "nothing changed" check).

    python benchmarks/ab_compare.py --base REV -- python benchmarks/X.py --output {out}

`{out}` is replaced by a JSON file per run; scripts missing at the base are copied from here.
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]


def run_in(tree: Path, command: list[str], out: Path) -> dict:
    argv = [arg.replace("{out}", str(out)) for arg in command]
    for arg in argv:  # a script the base does not have yet: take this tree's
        if arg.endswith(".py") and not (tree / arg).exists() and (ROOT / arg).exists():
            shutil.copy(ROOT / arg, tree / arg)
    env = os.environ | {"PYTHONPATH": str(tree)}
    subprocess.run(argv, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the commit to compare against")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "ab_compare.json")
    p.add_argument("command", nargs="+")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ab-compare-"))
    base = work / "base"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.base], cwd=ROOT,
                   check=True)  # fmt: skip
    results = {"base": [], "head": []}
    try:
        runs = [(name, tree) for _ in range(args.repeats) for name, tree in
                (("base", base), ("head", ROOT))]  # fmt: skip
        for i, (name, tree) in enumerate(tqdm(runs, desc="runs")):
            results[name].append(run_in(tree, args.command, work / f"{name}-{i}.json"))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
        shutil.rmtree(work, ignore_errors=True)
    report = {"base": args.base, "command": args.command, **results}
    args.output.write_text(json.dumps(report, indent=2))
    for name, rows in results.items():
        for row in rows:
            print(name, json.dumps(row))


if __name__ == "__main__":
    main()
