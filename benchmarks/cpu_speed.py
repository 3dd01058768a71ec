"""CPU tokens/s of plain vs speculative decoding on SmolLM2-135M, batch 1 and 8, side by side.

Every configuration runs in its own subprocess, so each reports its own peak RSS. GSM8K test
questions with the chat template, greedy, fp32. Writes benchmarks/cpu_speed.json.

    python benchmarks/cpu_speed.py [--max-tokens 64] [--threads 1] [--k 3] [--conversion] \
        [--also-drafter DIR]
"""

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_config(spec: dict) -> dict:
    """One configuration, in this (child) process."""
    import torch
    from tqdm import tqdm

    torch.set_num_threads(spec["threads"])
    capture = LogCapture()
    logging.getLogger().addHandler(capture)
    logging.getLogger().setLevel(logging.INFO)
    from deployments.prompt_sets import load_prompts
    from speculative.config import EngineConfig, SamplingParams
    from speculative.engine.llm_engine import LLMEngine, encode_prompt

    start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            drafter=spec["drafter"],
            num_draft_tokens=spec["k"],
            max_batch_size=spec["batch"],
            max_model_len=512,
            device="cpu",
            dtype="float32",
        )
    )
    load_s = time.perf_counter() - start
    questions = load_prompts(None, spec["num_prompts"])  # GSM8K test
    prompts = [encode_prompt(engine.tokenizer, q) for q in questions]
    params = SamplingParams(max_tokens=spec["max_tokens"])
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    requests = [engine.add_request(p, params) for p in prompts]
    bar = tqdm(
        total=len(prompts) * spec["max_tokens"], desc=spec["name"], unit="tok", file=sys.stderr
    )
    start = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            bar.update(len(out.new_token_ids))
    gen_s = time.perf_counter() - start
    bar.close()
    num_tokens = sum(len(r.output_ids) for r in requests)
    steps = engine.scheduler.stats
    return {
        **spec,
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "num_tokens": num_tokens,
        "tokens_per_s": round(num_tokens / gen_s, 2),
        "acceptance_length": round(sum(r.acceptance_length for r in requests) / len(requests), 3),
        "draft_acceptance_rate": round(
            steps.num_draft_accepted / max(steps.num_draft_proposed, 1), 4
        ),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "runner_log": [
            line for line in capture.lines if "bytes per token" in line or "loaded" in line
        ],
        "output_ids": [r.output_ids for r in requests],
    }


def measure_conversion(threads: int) -> dict:
    """GGUF -> safetensors conversion on a fresh cache, then the cached load, each timed in the
    child."""
    import torch

    torch.set_num_threads(threads)
    from speculative.config import EngineConfig
    from workers.model_runner import ModelRunner
    from workers.models.loader import resolve_model

    out = {}
    for label in ("first_load_with_conversion_s", "cached_load_s"):
        start = time.perf_counter()
        resolve_model("smollm2-135m")
        ModelRunner(EngineConfig(drafter="none", max_batch_size=1, max_model_len=512, device="cpu"))
        out[label] = round(time.perf_counter() - start, 2)
    return out


def child(args_json: str) -> None:
    spec = json.loads(args_json)
    result = measure_conversion(spec["threads"]) if spec.get("conversion") else run_config(spec)
    print("RESULT " + json.dumps(result))


def in_subprocess(spec: dict, env: dict | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        env=(os.environ | {"OMP_NUM_THREADS": str(spec["threads"])} | (env or {})),
        text=True,
        cwd=HERE.parent,
    )
    if proc.returncode != 0:
        raise SystemExit(f"configuration {spec.get('name')} failed (exit {proc.returncode})")
    return json.loads(
        next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:]
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (1 by default: on a small shared machine more threads contend)",
    )
    p.add_argument(
        "--conversion", action="store_true", help="also time the GGUF conversion on a fresh cache"
    )
    p.add_argument(
        "--also-drafter",
        help="a second drafter directory, measured in the same run (eagle3-alt rows)",
    )
    p.add_argument("--output", type=Path, default=HERE / "cpu_speed.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)

    sys.path.insert(0, str(HERE.parent))
    from speculative.drafter_format import DEFAULT_DRAFTERS

    trained = (DEFAULT_DRAFTERS["smollm2-135m"] / "config.json").is_file()
    drafter_note = (
        "trained drafter speculative/drafters/smollm2-135m"
        if trained
        else "random-weight default drafter "
        "(no trained drafter in speculative/drafters/smollm2-135m): "
        "acceptance ~1.0 token/step, so speculation only adds work and is expected to be slower"
    )
    also = (
        str(Path(args.also_drafter).resolve()) if args.also_drafter else None
    )  # the children run elsewhere
    configs = []
    for batch, num_prompts in ((1, 4), (8, 8)):
        for name, drafter in (("plain", "none"), ("eagle3", "default"), ("eagle3-alt", also)):
            if drafter is None:
                continue
            configs.append(
                {
                    "name": f"{name}-b{batch}",
                    "drafter": drafter,
                    "k": args.k,
                    "batch": batch,
                    "num_prompts": num_prompts,
                    "max_tokens": args.max_tokens,
                    "threads": args.threads,
                }
            )
    results = [in_subprocess(c) for c in configs]
    by_name = {r["name"]: r for r in results}
    for r in results:
        if not r["name"].startswith("plain"):
            plain = by_name[f"plain-b{r['batch']}"]
            r["speedup_vs_plain"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
            r["identical_to_plain"] = r["output_ids"] == plain["output_ids"]
    report = {
        "model": "smollm2-135m (fp32, CPU)",
        "drafter": drafter_note,
        "also_drafter": args.also_drafter,
        "threads": args.threads,
        "prompts": "GSM8K test, chat template, greedy",
        "cpu_count": os.cpu_count(),
        "results": [{k: v for k, v in r.items() if k != "output_ids"} for r in results],
    }
    if args.conversion:
        with tempfile.TemporaryDirectory(prefix="eagleserve-fresh-") as fresh:
            report["conversion"] = in_subprocess(
                {"conversion": True, "threads": args.threads}, {"EAGLESERVE_CACHE": fresh}
            )
    args.output.write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"\nSmolLM2-135M on CPU ({args.threads} thread(s)), {args.max_tokens} new tokens, "
        f"K={args.k}"
    )
    print(f"drafter: {drafter_note}\n")
    print(
        f"{'config':<13} {'batch':>5} {'tok/s':>8} {'vs plain':>8} {'accept len':>10} "
        f"{'peak RSS MiB':>12} "
        f"{'load s':>7} {'same tokens':>11}"
    )
    for r in results:
        print(
            f"{r['name']:<13} {r['batch']:>5} {r['tokens_per_s']:>8.2f} "
            f"{r.get('speedup_vs_plain', 1.0):>8.2f} "
            f"{r['acceptance_length']:>10.2f} {r['peak_rss_mib']:>12.0f} {r['load_s']:>7.1f} "
            f"{str(r.get('identical_to_plain', '-')):>11}"
        )
    for r in results:
        for line in r["runner_log"]:
            print(f"  [{r['name']}] {line}")
    if "conversion" in report:
        print(f"\nGGUF conversion: {report['conversion']}")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
