"""Tokens/s and acceptance of json_schema requests against unconstrained ones, with and without
speculation (EAGLE-3, K=5), side by side in one process (SmolLM2-135M, greedy, the overlapped
loop): a batch of unconstrained requests, a batch of constrained ones, and a mixed batch (half
each), whose two halves are timed apart to show what constrained requests cost the others. Also
the host time spent on grammars (masks along the drafts, following the output). On a CPU (fp32)
it writes benchmarks/structured_speed_cpu.json; on a GPU (--device cuda, bf16, CUDA graphs) give
the GGUF and the drafter by path, and --rounds to keep each mix's median round:

    python benchmarks/structured_speed.py [--batch 8] [--max-tokens 64] [--threads 1]
    python3 benchmarks/structured_speed.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --drafter speculative/drafters/smollm2-135m --max-tokens 128 --rounds 3 --out $OUT/s.json
"""

import argparse
import gc
import json
import os
import time

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
}
QUESTIONS = [
    "Describe a person who lives in Paris.",
    "Invent a character for a novel.",
    "Tell me about a retired teacher.",
    "Describe a young programmer.",
    "Describe a famous chef.",
    "Invent a sailor from Lisbon.",
    "Describe a student in Tokyo.",
    "Tell me about a musician.",
]


def timed_grammar_host(scheduler) -> dict:
    """Wrap the scheduler's grammar hooks to sum their host time."""
    spent = {"s": 0.0}
    for name in ("_add_grammar_masks", "_follow_grammar"):
        original = getattr(scheduler, name)

        def timed(*args, _original=original):
            start = time.perf_counter()
            out = _original(*args)
            spent["s"] += time.perf_counter() - start
            return out

        setattr(scheduler, name, timed)
    return spent


def run_batch(engine, prompts, params, host) -> dict:
    """All requests at once; per group (constrained, free): tokens/s over the time until the
    group's last request finished, and each request's own tokens/s (its tokens over its time to
    finish), averaged: what a client sees, comparable between batches of different mixes."""
    stats = engine.scheduler.stats
    before = (stats.num_verify_rows, stats.num_draft_accepted, host["s"])
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    start, done_at = time.perf_counter(), {}
    while engine.has_work:
        engine.step()
        for r in requests:
            if r.is_finished and r.request_id not in done_at:
                done_at[r.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    out = {"wall_s": wall, "grammar_host_s": host["s"] - before[2]}
    for kind in ("constrained", "free"):
        group = [
            r for r in requests if (r.params.structured is not None) == (kind == "constrained")
        ]
        if group:
            tokens = sum(len(r.output_ids) for r in group)
            last = max(done_at[r.request_id] for r in group)
            own = [len(r.output_ids) / done_at[r.request_id] for r in group]
            out[kind] = {
                "requests": len(group),
                "tokens": tokens,
                "tokens_per_s": tokens / last,
                "request_tokens_per_s": sum(own) / len(own),
            }
    rows = stats.num_verify_rows - before[0]
    out["acceptance_length"] = 1 + (stats.num_draft_accepted - before[1]) / max(rows, 1)
    return out


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="default", help="the speculative runs' drafter")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on a CPU, else auto (bf16)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each mix; the median is kept")
    pool_help = "the KV pool in GiB (default: the engine's sizing, on a GPU by profiling)"
    ap.add_argument("--kv-cache-gb", type=float, default=None, help=pool_help)
    ap.add_argument("--out", default="benchmarks/structured_speed_cpu.json")
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "auto")
    return args


def median_round(engine, prompts, params, host, rounds: int) -> dict:
    """The round of median wall time among `rounds` runs of one batch, with every round's wall."""
    runs = sorted((run_batch(engine, prompts, params, host) for _ in range(rounds)),
                  key=lambda r: r["wall_s"])  # fmt: skip
    return runs[len(runs) // 2] | {"rounds_wall_s": [r["wall_s"] for r in runs]}


def main() -> None:
    import torch

    from speculative.config import EngineConfig, SamplingParams, StructuredSpec
    from speculative.engine.llm_engine import LLMEngine, encode_prompt

    args = parse_args()
    torch.set_num_threads(args.threads)
    spec = StructuredSpec(kind="json", spec=json.dumps(PERSON))
    free = SamplingParams(max_tokens=args.max_tokens)
    constrained = SamplingParams(max_tokens=args.max_tokens, structured=spec)
    mixes = {
        "free": [free] * args.batch,
        "json_schema": [constrained] * args.batch,
        "mixed": [constrained, free] * (args.batch // 2),
    }
    results = {"batch": args.batch, "max_tokens": args.max_tokens, "threads": args.threads,
               "model": os.path.basename(args.model), "drafter": args.drafter, "k": args.k,
               "device": args.device, "dtype": args.dtype, "rounds": args.rounds}  # fmt: skip
    for drafter, label in (("none", "none"), (args.drafter, "default")):
        cfg = EngineConfig(
            model=args.model, drafter=drafter, num_draft_tokens=args.k,
            max_batch_size=args.batch, max_model_len=512, device=args.device, dtype=args.dtype,
            kv_cache_memory_gb=args.kv_cache_gb,
        )  # fmt: skip
        engine = LLMEngine(cfg)
        host = timed_grammar_host(engine.scheduler)
        prompts = [encode_prompt(engine.tokenizer, QUESTIONS[i % 8]) for i in range(args.batch)]
        run_batch(engine, prompts[:2], mixes["mixed"][:2], host)  # warm-up (and the compile)
        for name, params in mixes.items():
            key = f"{name}/{label}"
            results[key] = median_round(engine, prompts, params, host, args.rounds)
        del engine, host
        gc.collect()  # its memory back before the next engine sizes its KV pool from what is free
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


def print_table(results: dict) -> None:
    print(
        f"{'batch/drafter':22} {'group':12} {'tok/s':>8} {'req tok/s':>10} {'accept':>7} "
        f"{'grammar host s':>15}"
    )
    for key, r in results.items():
        if not isinstance(r, dict):
            continue
        for group in ("constrained", "free"):
            if group in r:
                print(
                    f"{key:22} {group:12} {r[group]['tokens_per_s']:8.1f} "
                    f"{r[group]['request_tokens_per_s']:10.2f} {r['acceptance_length']:7.2f} "
                    f"{r['grammar_host_s']:15.3f}"
                )


if __name__ == "__main__":
    main()
