"""Mean acceptance length (1 + accepted drafts per target forward) of one or more drafters,
side by side, on the EAGLE benchmark sets, GSM8K test and the held-out writing and code sets
(deployments/data/heldout: in no training set), chat template applied, for several K and
temperatures.

    python benchmarks/acceptance.py --drafter speculative/drafters/smollm2-135m --k 3 5 \
        --temperatures 0 0.7 --output benchmarks/acceptance.json
    python benchmarks/acceptance.py --drafter default drafters/mine --k 3 --temperatures 0
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deployments.prompt_sets import (  # noqa: E402
    EAGLE_SETS,
    HELDOUT_SETS,
    eagle_set,
    heldout_set,
    load_prompts,
)
from speculative.config import EngineConfig, SamplingParams  # noqa: E402
from speculative.engine.llm_engine import LLMEngine, encode_prompt  # noqa: E402


def load_sets(
    num_gsm8k_test: int, names=EAGLE_SETS, heldout=HELDOUT_SETS, num_heldout: int = 0
) -> dict[str, list[str]]:
    """The shipped EAGLE sets (every question), the first GSM8K test questions and the first
    `num_heldout` (0: all) of each held-out set, by name."""
    sets = {f"eagle_{name}": load_prompts(str(eagle_set(name)), 0) for name in names}
    if num_gsm8k_test:
        sets["gsm8k_test"] = load_prompts(None, num_gsm8k_test)
    for name in heldout:
        sets[f"heldout_{name}"] = load_prompts(str(heldout_set(name)), num_heldout)
    return sets


def measure(
    engine: LLMEngine, prompts: list[list[int]], temperature: float, max_tokens: int
) -> dict:
    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=0 if temperature else None
    )
    start = time.perf_counter()
    requests = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    steps = sum(r.num_verify_steps for r in requests)
    return {
        "acceptance_length": round(sum(r.num_verify_emitted for r in requests) / max(steps, 1), 4),
        "mean_request_acceptance": round(
            sum(r.acceptance_length for r in requests) / len(requests), 4
        ),
        "num_prompts": len(requests),
        "output_tokens": sum(len(r.output_ids) for r in requests),
        "target_forwards": steps,
        "seconds": round(seconds, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--drafter",
        nargs="+",
        default=["default"],
        help="drafters to compare, side by side (default, or directories)",
    )
    p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument(
        "--sets", nargs="+", default=list(EAGLE_SETS), choices=EAGLE_SETS, help="EAGLE sets to run"
    )
    p.add_argument("--num-gsm8k-test", type=int, default=200, help="GSM8K test questions (0: none)")
    p.add_argument(
        "--heldout-sets",
        nargs="*",
        default=list(HELDOUT_SETS),
        choices=HELDOUT_SETS,
        help="held-out sets to run (none: no flag values)",
    )
    p.add_argument(
        "--num-heldout", type=int, default=0, help="prompts of each held-out set (0: all)"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--prompt-lookup", type=float, default=0.0, help="EngineConfig.prompt_lookup (0: off)"
    )
    p.add_argument(
        "--siblings",
        type=int,
        nargs="+",
        default=[0],
        help="EngineConfig.draft_siblings values (0: a chain)",
    )
    p.add_argument("--output", type=Path, help="results JSON")
    args = p.parse_args(argv)
    sets = load_sets(args.num_gsm8k_test, args.sets, args.heldout_sets, args.num_heldout)
    results = []
    for drafter, k, siblings in itertools.product(args.drafter, args.k, args.siblings):
        # the runner pads a prefill batch to its longest prompt, so budget for the padded size
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                drafter=drafter,
                num_draft_tokens=k,
                max_batch_size=args.max_batch_size,
                max_model_len=2048,
                max_num_batched_tokens=args.max_batch_size * 2048,
                device=args.device,
                prompt_lookup=args.prompt_lookup,
                draft_siblings=siblings,
            )
        )
        engine.scheduler.tokenizer = None  # acceptance needs no detokenizing
        encoded = {
            name: [encode_prompt(engine.tokenizer, text) for text in texts]
            for name, texts in sets.items()
        }
        for temperature in args.temperatures:
            for name, prompts in encoded.items():
                row = {
                    "set": name,
                    "drafter": drafter,
                    "k": k,
                    "siblings": siblings,
                    "temperature": temperature,
                    **measure(engine, prompts, temperature, args.max_tokens),
                }
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        del engine
    print_table(results)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "drafters": args.drafter,
                    "max_tokens": args.max_tokens,
                    "prompt_lookup": args.prompt_lookup,
                    "results": results,
                },
                indent=2,
            )
        )


def print_table(results: list[dict]) -> None:
    """One row per set; a column per (drafter, K, siblings, temperature)."""
    labels = drafter_labels(list(dict.fromkeys(r.get("drafter", "") for r in results)))

    def column(r):
        return (r.get("drafter", ""), r["k"], r.get("siblings", 0), r["temperature"])

    columns = list(dict.fromkeys(column(r) for r in sorted(results, key=_column_order)))
    names = list(dict.fromkeys(r["set"] for r in results))
    print(
        "| set | "
        + " | ".join(
            f"{labels[d] + ' ' if len(labels) > 1 else ''}K={k}{f' M={m}' if m else ''} T={t:g}"
            for d, k, m, t in columns
        )
        + " |"
    )
    print("|---|" + "---|" * len(columns))
    for name in names:
        cells = {column(r): r["acceptance_length"] for r in results if r["set"] == name}
        print(
            f"| {name} | " + " | ".join(f"{cells.get(c, float('nan')):.2f}" for c in columns) + " |"
        )


def _column_order(r: dict):
    # side by side: the drafters' columns of one (K, siblings, temperature) next to each other
    return (r["k"], r.get("siblings", 0), r["temperature"])


def drafter_labels(drafters: list[str]) -> dict[str, str]:
    """Short names: a directory's last part (its index where two share one)."""
    names = [Path(d).name or d for d in drafters]
    return {
        d: name if names.count(name) == 1 else f"{name}#{i}"
        for i, (d, name) in enumerate(zip(drafters, names))
    }


if __name__ == "__main__":
    main()
