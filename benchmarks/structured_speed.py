"""Tokens/s and tokens per step of structured outputs (json_schema, forced tool calls) against free
text on the same prompts, plain against speculative (EAGLE-3, K=5), side by side in one process
(SmolLM2-135M, greedy, the overlapped loop), one request at a time and in batches (--batch 1,8;
on a GPU 1,8,32). Speculative runs twice: with drafts that follow the grammar
(workers/draft_grammar.py) and with free drafts (that module off, as before it), so the gain of
each is read beside the other. A mixed batch (json_schema and free halves) times its halves apart.
Also the host time of grammars: the engine's masks along the drafts, and the ranks' draft masks
per step with constrained rows (waits for the drafts included). On a CPU (fp32) it writes
benchmarks/structured_speed_cpu.json; on a GPU (--device cuda, bf16, CUDA graphs) give the GGUF
and the drafter by path, and --rounds to keep each run's median round:

    python benchmarks/structured_speed.py [--batch 1,8] [--max-tokens 64] [--threads 1]
    python3 benchmarks/structured_speed.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --drafter speculative/drafters/smollm2-135m --batch 1,8,32 --max-tokens 128 --rounds 3 \
        --out $OUT/s.json
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
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
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
TOOL_QUESTIONS = [
    "What is the weather in Paris?",
    "Is it cold in Oslo today?",
    "Will it rain in London?",
    "How warm is it in Cairo, in fahrenheit?",
    "What's the temperature in Tokyo?",
    "Do I need a coat in Chicago?",
    "Weather in Lisbon please.",
    "Is it sunny in Sydney?",
]
# (label, drafter, drafts follow the grammar)
VARIANTS = (("plain", False, False), ("free_drafts", True, False), ("spec", True, True))


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
    group's last request finished, each request's own tokens/s (its tokens over its time to
    finish) averaged, what a client sees, and tokens per verify step (1 + accepted drafts)."""
    before = (host["s"], *draft_host(engine))
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    start, done_at = time.perf_counter(), {}
    while engine.has_work:
        engine.step()
        for r in requests:
            if r.is_finished and r.request_id not in done_at:
                done_at[r.request_id] = time.perf_counter() - start
    draft_s, num_steps = (now - then for now, then in zip(draft_host(engine), before[1:]))
    out = {
        "wall_s": time.perf_counter() - start,
        "grammar_host_s": host["s"] - before[0],
        "draft_steps": num_steps,
        "draft_host_ms_per_step": 1e3 * draft_s / max(num_steps, 1),
    }
    for kind in ("constrained", "free"):
        group = [
            r for r in requests if (r.params.structured is not None) == (kind == "constrained")
        ]
        if group:
            own = [len(r.output_ids) / done_at[r.request_id] for r in group]
            out[kind] = {
                "requests": len(group),
                "tokens": sum(len(r.output_ids) for r in group),
                "tokens_per_s": sum(len(r.output_ids) for r in group)
                / max(done_at[r.request_id] for r in group),
                "request_tokens_per_s": sum(own) / len(own),
                "tokens_per_step": sum(r.acceptance_length for r in group) / len(group),
            }
    return out


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
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
    args.batches = [int(b) for b in args.batch.split(",")]
    return args


def median_round(engine, prompts, params, host, rounds: int) -> dict:
    """The round of median wall time among `rounds` runs of one batch, with every round's wall."""
    runs = sorted((run_batch(engine, prompts, params, host) for _ in range(rounds)),
                  key=lambda r: r["wall_s"])  # fmt: skip
    return runs[len(runs) // 2] | {"rounds_wall_s": [r["wall_s"] for r in runs]}


def warm_up(engine, prompts, params, host, max_tokens: int = 16) -> None:
    """One untimed run of a configuration before it is timed: its grammars compiled, its batch's
    graphs and kernels run once (a cold first run read a quarter of the warm speed on an H100)."""
    short = [p.model_copy(update={"max_tokens": min(p.max_tokens, max_tokens)}) for p in params]
    run_batch(engine, prompts, short, host)


def mixes(tokenizer, batch: int, max_tokens: int) -> dict:
    """Each mix's prompts and parameters at this batch: free text and json_schema on the same
    prompts, forced tool calls, and (batch 2 or more) json_schema and free halves."""
    from speculative.config import SamplingParams, StructuredSpec
    from speculative.engine.llm_engine import encode_prompt
    from speculative.grammar import tool_call_schema

    def encoded(questions):
        return [encode_prompt(tokenizer, questions[i % len(questions)]) for i in range(batch)]

    schema = StructuredSpec(kind="json", spec=json.dumps(PERSON))
    tools = StructuredSpec(kind="json", spec=json.dumps(tool_call_schema([WEATHER], "required")))
    free, person = SamplingParams(max_tokens=max_tokens), encoded(QUESTIONS)
    out = {
        "free": (person, [free] * batch),
        "json_schema": (person, [free.model_copy(update={"structured": schema})] * batch),
        "tool_call": (
            encoded(TOOL_QUESTIONS),
            [free.model_copy(update={"structured": tools})] * batch,
        ),
    }
    if batch >= 2:
        out["mixed"] = (person, [out["json_schema"][1][0], free] * (batch // 2))
    return out


def main() -> None:
    import torch

    from speculative.config import EngineConfig

    args = parse_args()
    torch.set_num_threads(args.threads)
    results = {"batches": args.batches, "max_tokens": args.max_tokens, "threads": args.threads,
               "model": os.path.basename(args.model), "drafter": args.drafter, "k": args.k,
               "device": args.device, "dtype": args.dtype, "rounds": args.rounds}  # fmt: skip
    for drafter in ("none", args.drafter):
        engine = new_engine(EngineConfig, args, drafter)
        host = timed_grammar_host(engine.scheduler)
        following = engine.executor.draft_grammars
        for batch in args.batches:
            for name, (prompts, params) in mixes(engine.tokenizer, batch, args.max_tokens).items():
                for label, speculative, follows in VARIANTS:
                    if speculative != (drafter != "none"):
                        continue
                    engine.executor.draft_grammars = following if follows else None
                    key = f"{batch}/{name}/{label}"
                    warm_up(engine, prompts, params, host)
                    results[key] = median_round(engine, prompts, params, host, args.rounds)
        del engine, host, following
        gc.collect()  # its memory back before the next engine sizes its KV pool from what is free
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(results)
    print("each configuration warmed by an untimed run (16 tokens) before it was timed")
    print_goals(results)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


def new_engine(EngineConfig, args, drafter: str):
    """An engine for every batch size, warmed up (and the grammars compiled) by a first run."""
    from speculative.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=args.model, drafter=drafter, num_draft_tokens=args.k,
        max_batch_size=max(args.batches), max_model_len=512, device=args.device,
        dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_gb,
    )  # fmt: skip
    engine = LLMEngine(cfg)
    warm = mixes(engine.tokenizer, 2, 8)
    for prompts, params in (warm["mixed"], warm["tool_call"]):
        engine.generate(prompts, params)
    return engine


def print_table(results: dict) -> None:
    """Per batch, mix and group: tok/s plain, with free drafts, with drafts following the grammar
    (ratios to plain), tokens per step of both, the draft masks' host ms per step."""
    print(
        f"{'batch/mix':16} {'group':11} {'plain':>7} {'free drafts':>17} {'spec':>17} "
        f"{'tok/step free/spec':>19} {'draft host ms':>13}"
    )
    for key in [k for k in results if k.endswith("/plain")]:
        base = key[: -len("/plain")]
        plain, free, spec = (results[f"{base}/{v}"] for v, _, _ in VARIANTS)
        for group in ("constrained", "free"):
            if group not in plain:
                continue
            p, f, s = (r[group]["tokens_per_s"] for r in (plain, free, spec))
            steps = f"{free[group]['tokens_per_step']:.2f} / {spec[group]['tokens_per_step']:.2f}"
            print(
                f"{base:16} {group:11} {p:7.1f} {f:8.1f} ({f / p:4.2f}x) {s:8.1f} ({s / p:4.2f}x) "
                f"{steps:>19} {spec['draft_host_ms_per_step']:13.2f}"
            )


def print_goals(results: dict) -> None:
    """The goals of drafts that follow the grammar, per batch, speculative: constrained tokens per
    step against free text's on the same prompts (>= 1), and tokens/s (>= 0.85 at batch 8)."""
    for batch in results["batches"]:
        free = results[f"{batch}/free/spec"]["free"]
        for mix in ("json_schema", "tool_call"):
            spec = results[f"{batch}/{mix}/spec"]["constrained"]
            steps = spec["tokens_per_step"] / free["tokens_per_step"]
            speed = spec["tokens_per_s"] / free["tokens_per_s"]
            print(f"batch {batch} {mix}: tokens/step {steps:.2f}x free text's, tok/s {speed:.2f}x")


def draft_host(engine) -> tuple[float, int]:
    """The ranks' draft masks so far: host seconds, steps (none while they are off)."""
    draft = engine.executor.draft_grammars
    return (draft.host_s, draft.num_steps) if draft is not None else (0.0, 0)


if __name__ == "__main__":
    main()
