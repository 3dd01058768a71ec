"""What the paged KV pool buys, as ratios measured in one run; greedy, and the same tokens checked
throughout (on a GPU in bf16 a different chunking may legitimately change a near-tie):

1. concurrency: requests served at once from one fixed KV memory, paged pool against per-slot
   caches of max_model_len each (what memory_budget_gb gives);
2. prefix cache: time to first token of a request whose long prefix is cached, against cold;
3. chunked prefill: the longest stall of running streams while a long prompt arrives, chunked
   (max_num_batched_tokens) against whole.
Also the KV capacity the engine logs at start (blocks, tokens, concurrency) at its default sizing.
--repeats takes the median of several TTFTs and stalls (each with its own prompts).

    python benchmarks/paged_kv.py [--model smollm2-135m] [--prefix-len 2500] [--long-len 6000]
        [--budget 512] [--out benchmarks/paged_kv.json]
    python3 benchmarks/paged_kv.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --drafter speculative/drafters/smollm2-135m --repeats 3 --out $OUT/paged_kv_gpu.json
"""

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.llm_engine import LLMEngine

HERE = Path(__file__).resolve().parent


def engine(args, **overrides) -> LLMEngine:
    cfg = dict(
        model=args.model, drafter=args.drafter, num_draft_tokens=3, max_batch_size=16,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_model_len,
        device=args.device, dtype=args.dtype,
    )  # fmt: skip
    e = LLMEngine(EngineConfig(**(cfg | overrides)))
    e.generate([filler(e, 40, 0)], SamplingParams(max_tokens=8))  # untimed: kernels warm
    return e


def release() -> None:
    """Give a dropped engine's memory back: the next one may size its pool from free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kv_capacity(e: LLMEngine) -> dict:
    runner = e.executor
    return {"line": runner.kv.capacity(runner.max_model_len), "num_blocks": runner.num_blocks,
            "block_size": runner.block_size, "num_slots": runner.num_slots}  # fmt: skip


def filler(engine: LLMEngine, n: int, seed: int) -> list[int]:
    """n token ids of plain words (a deterministic pseudo-text)."""
    words = engine.tokenizer.encode(" the a of river stone light quiet number seven under over")
    return [words[(i * 7 + seed * 13 + i // 5) % len(words)] for i in range(n)]


def run_timed(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams, int]]):
    """requests: (prompt, params, engine steps before it joins). -> the requests, each token's
    arrival time per request, and the most requests running at once."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    added, arrivals, steps, peak = {}, {}, 0, 0
    while pending or engine.has_work:
        while pending and requests[pending[0]][2] <= steps:
            i = pending.pop(0)
            added[i] = engine.add_request(requests[i][0], requests[i][1])
            arrivals[added[i].request_id] = [time.perf_counter()]  # the first: when added
        for out in engine.step():
            arrivals[out.request_id] += [time.perf_counter()] * len(out.new_token_ids)
        peak = max(peak, engine.scheduler.num_running)
        steps += 1
    ordered = [added[i] for i in range(len(requests))]
    return ordered, [arrivals[r.request_id] for r in ordered], peak


def concurrency(args) -> dict:
    """The same KV memory as per-slot caches and as a paged pool, 16 short requests."""
    # a pool of a few blocks: the probe only reads shapes (on a GPU no profiling either)
    probe = engine(args, max_batch_size=1, cuda_graphs=False, kv_cache_memory_gb=0.01)
    per_slot = probe.executor.kv.bytes_per_token * probe.executor.kv.cache_len
    budget_gb = args.slots * per_slot / 2**30
    prompts = [filler(probe, 60 + 10 * i, i) for i in range(16)]
    del probe
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    work = [(p, params, 0) for p in prompts]
    runs = {}
    for name, sizing in (("slots", "memory_budget_gb"), ("paged", "kv_cache_memory_gb")):
        release()
        reqs, _, peak = run_timed(engine(args, **{sizing: budget_gb}), work)
        runs[name] = (peak, [r.output_ids for r in reqs])
    (slot_peak, slot_ids), (paged_peak, paged_ids) = runs["slots"], runs["paged"]
    return {"kv_gb": budget_gb, "slot_cache_peak_running": slot_peak,
            "paged_peak_running": paged_peak, "ratio": paged_peak / slot_peak,
            "same_tokens": slot_ids == paged_ids}  # fmt: skip


def prefix_ttft(args) -> dict:
    """TTFT of prefix + question, cold (caching off) and with the prefix cached by a request
    before it; --repeats questions, the median. Also the cold engine's KV capacity."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    results = {}
    for name, caching in (("cold", False), ("cached", True)):
        release()
        e = engine(args, enable_prefix_caching=caching)
        prefix = filler(e, args.prefix_len, 1)
        run_timed(e, [(prefix + filler(e, 20, 2), params, 0)])
        ttfts, tokens = [], []
        for i in range(args.repeats):
            (r,), (times,), _ = run_timed(e, [(prefix + filler(e, 20, 3 + i), params, 0)])
            ttfts.append(times[1] - times[0])
            tokens.append(r.output_ids)
        results[name] = {"ttft_s": statistics.median(ttfts), "all_s": ttfts, "tokens": tokens}
        results[name]["kv"] = kv_capacity(e)
        del e
    cold, cached = results["cold"], results["cached"]
    return {"prefix_len": args.prefix_len, "cold_ttft_s": cold["ttft_s"],
            "cached_ttft_s": cached["ttft_s"], "speedup": cold["ttft_s"] / cached["ttft_s"],
            "cold_all_s": cold["all_s"], "cached_all_s": cached["all_s"],
            "same_tokens": cold["tokens"] == cached["tokens"],
            "kv_capacity": cold["kv"]}  # fmt: skip


def longest_stall(e: LLMEngine, args, seed: int) -> tuple[float, list]:
    """Two streams run; a long prompt joins; the longest gap between a stream's tokens."""
    stream = SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True)
    work = [(filler(e, 40, seed), stream, 0), (filler(e, 50, seed + 1), stream, 0),
            (filler(e, args.long_len, seed + 2), SamplingParams(max_tokens=8), 4)]  # fmt: skip
    reqs, times, _ = run_timed(e, work)
    gaps = [b - a for t in times[:2] for a, b in zip(t[2:], t[3:])]  # after the first token
    return max(gaps), [r.output_ids for r in reqs]


def chunked_stall(args) -> dict:
    """The longest stall, whole prefill against chunked (--repeats runs, the median); caching
    off, so a repeat's prompts are computed again."""
    results = {}
    for name, budget in (("whole", args.max_model_len), ("chunked", args.budget)):
        release()
        e = engine(args, max_num_batched_tokens=budget, enable_prefix_caching=False)
        runs = [longest_stall(e, args, 4 + 3 * i) for i in range(args.repeats)]
        stalls = [stall for stall, _ in runs]
        results[name] = {"stall_s": statistics.median(stalls), "all_s": stalls,
                         "tokens": [tokens for _, tokens in runs]}  # fmt: skip
        del e
    whole, chunked = results["whole"], results["chunked"]
    return {"long_len": args.long_len, "budget": args.budget,
            "whole_stall_s": whole["stall_s"], "chunked_stall_s": chunked["stall_s"],
            "ratio": whole["stall_s"] / chunked["stall_s"], "whole_all_s": whole["all_s"],
            "chunked_all_s": chunked["all_s"],
            "same_tokens": whole["tokens"] == chunked["tokens"]}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--slots", type=int, default=2, help="per-slot caches the KV memory holds")
    p.add_argument("--prefix-len", type=int, default=2500)
    p.add_argument("--long-len", type=int, default=6000)
    p.add_argument("--budget", type=int, default=512, help="chunked max_num_batched_tokens")
    p.add_argument("--stream-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=1, help="TTFTs and stalls, the median kept")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on a CPU, else auto (bf16)")
    p.add_argument("--out", type=Path, default=HERE / "paged_kv.json")
    args = p.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "auto")
    report = {"device": args.device, "dtype": args.dtype}
    for name, measure in (("concurrency", concurrency), ("prefix_cache", prefix_ttft),
                          ("chunked_prefill", chunked_stall)):  # fmt: skip
        print(f"== {name}", flush=True)
        report[name] = measure(args)
    print(f"{'measure':<44}{'baseline':>12}{'paged':>12}{'ratio':>8}  same tokens")
    c, f, s = report["concurrency"], report["prefix_cache"], report["chunked_prefill"]
    rows = [
        ("requests at once (same KV memory)", c["slot_cache_peak_running"],
         c["paged_peak_running"], c["ratio"], c["same_tokens"]),
        (f"TTFT s, {f['prefix_len']}-token prefix cold/cached", f["cold_ttft_s"],
         f["cached_ttft_s"], f["speedup"], f["same_tokens"]),
        (f"longest stream stall s, {s['long_len']}-token prompt", s["whole_stall_s"],
         s["chunked_stall_s"], s["ratio"], s["same_tokens"]),
    ]  # fmt: skip
    for name, base, paged, ratio, same in rows:
        print(f"{name:<44}{base:>12.3f}{paged:>12.3f}{ratio:>8.2f}  {same}")
    print(f"KV at the default sizing: {f['kv_capacity']['line']}")
    print("each engine warmed by an untimed request before it was timed")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
