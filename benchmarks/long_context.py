"""Long contexts on one GPU, through the engine: a Llama-3.1-8B-shaped target with random weights
(and a random EAGLE-3 head shaped like yuhuili's, a 32000-token draft vocabulary) at its default
131072-token context and gpu_memory_utilization 0.9. Per engine, plain and EAGLE-3 K=3:

- start-up: seconds, the KV pool it sized, the peak GPU memory;
- TTFT of a 32k-token prompt (chunked prefill under --budget tokens a step);
- decode at 32k and 128k of context: ms per step and per token, tokens per step (a random head
  accepts almost nothing: the EAGLE-3 rows measure what speculation costs, not what it buys),
  beside the target pass's floor: its weights plus the row's KV read once at the measured copy
  bandwidth (a speculative step also reads the drafter K times);
- the longest stall of two running streams while a 32k-token prompt arrives.

Prints a table, writes JSON (default $OUT/long_context.json).

    python3 benchmarks/long_context.py          # on a GPU (several minutes)
    python3 benchmarks/long_context.py --tiny   # CPU dry run, a tiny model, short contexts
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import runner_bench as rb  # noqa: E402
from benchmarks.step_floor import bandwidth_bytes_per_s, read_bytes  # noqa: E402
from speculative.config import EngineConfig, SamplingParams  # noqa: E402
from speculative.engine.llm_engine import LLMEngine  # noqa: E402


def start(args, drafter: str) -> tuple[LLMEngine, dict]:
    rb.free_memory()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    cfg = EngineConfig(model=args.model, drafter=drafter, num_draft_tokens=args.k,
                       max_model_len=args.max_model_len, max_num_batched_tokens=args.budget,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       max_batch_size=args.max_batch_size, enable_prefix_caching=False,
                       device=args.device, seed=0)  # fmt: skip
    t0 = time.perf_counter()
    with rb.draft_vocab(args.draft_vocab):
        engine = LLMEngine(cfg)
    runner = engine.executor
    info = {"startup_s": time.perf_counter() - t0, "max_model_len": runner.max_model_len,
            "kv_capacity": runner.kv.capacity(runner.max_model_len),
            "kv_pool_gib": runner.kv.nbytes / 2**30, "num_slots": runner.num_slots,
            "peak_memory_gib": rb.peak_memory_gib(runner.device)}  # fmt: skip
    return engine, info


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def run(engine: LLMEngine, work: list[tuple[list[int], SamplingParams, int]]) -> list[list]:
    """work: (prompt, params, steps before it joins) -> each request's token arrival times (the
    first entry: when it was added), and the steps that ran."""
    pending, times, ids, steps = list(work), {}, [], 0
    while pending or engine.has_work:
        for item in [w for w in pending if w[2] <= steps]:
            pending.remove(item)
            r = engine.add_request(item[0], item[1])
            ids.append(r.request_id)
            times[r.request_id] = [time.perf_counter()]
        for out in engine.step():
            times[out.request_id] += [time.perf_counter()] * len(out.new_token_ids)
        steps += 1
    return [times[i] for i in ids], steps


def decode(engine: LLMEngine, context: int, args, floor_ms) -> dict:
    """One row at `context` tokens: ms per step and per token over --decode-tokens tokens."""
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    (t,), steps = run(engine, [(prompt(context, context, args.vocab), params, 0)])
    decode_steps = steps - -(-context // args.budget)  # minus the prefill's chunk steps
    span = t[-1] - t[1]  # first token to last
    row = {"context": context, "ttft_s": t[1] - t[0],
           "ms_per_token": span / (len(t) - 2) * 1000,
           "ms_per_step": span / max(decode_steps - 1, 1) * 1000,
           "tokens_per_step": (len(t) - 2) / max(decode_steps - 1, 1),
           "floor_ms": floor_ms(context)}  # fmt: skip
    row["step_over_floor"] = row["ms_per_step"] / row["floor_ms"]
    return row


def stall(engine: LLMEngine, args) -> float:
    stream = SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True)
    work = [(prompt(40, 1, args.vocab), stream, 0), (prompt(50, 2, args.vocab), stream, 0),
            (prompt(args.ttft_len, 3, args.vocab), SamplingParams(max_tokens=4), 4)]  # fmt: skip
    times, _ = run(engine, work)
    return max(b - a for t in times[:2] for a, b in zip(t[2:], t[3:]))


def measure(args, drafter: str, bandwidth: float) -> dict:
    try:
        engine, out = start(args, drafter)
    except Exception as e:  # a start that fails is the figure: say why
        return {"drafter": drafter, "started": False, "error": f"{type(e).__name__}: {e}"}
    runner = engine.executor
    weights = read_bytes(runner.target, runner.target_cfg.tie_word_embeddings)
    pool = runner.kv.target  # [layers, 2, blocks + 1, block_size, kv_heads, head_dim]
    per_token = pool[:, :, 0].nbytes / pool.shape[3]

    def floor_ms(context: int) -> float:  # the target pass's: its weights and this row's KV
        return (weights + per_token * context) / bandwidth * 1000

    out |= {"drafter": drafter, "started": True, "weights_gib": weights / 2**30,
            "kv_bytes_per_token": per_token}  # fmt: skip
    # untimed: the prefill and decode kernels compiled and every graph replayed once, at the
    # shortest context and at one past a prefill chunk
    for context in sorted({min(args.contexts), min(args.budget + 16, max(args.contexts))}):
        run(engine, [(prompt(context, 0, args.vocab), SamplingParams(max_tokens=8), 0)])
    out["ttft_s"] = decode(engine, args.ttft_len, args, floor_ms)["ttft_s"]
    out["decode"] = [decode(engine, c, args, floor_ms) for c in rb.progress(
        args.contexts, f"decode ({drafter})", "context")]  # fmt: skip
    out["stall_s"] = stall(engine, args)
    del engine, runner
    return out


def print_table(out: dict) -> None:
    print(f"{out['model']} on {out['device']}, bandwidth {out['bandwidth_tb_s']:.2f} TB/s")
    for e in out["engines"]:
        if not e["started"]:
            print(f"{e['drafter']}: did not start: {e['error']}")
            continue
        print(
            f"{e['drafter']}: start {e['startup_s']:.1f} s, {e['kv_capacity']}; TTFT "
            f"{e['ttft_len']} tokens {e['ttft_s']:.2f} s; longest stall {e['stall_s']:.3f} s"
        )
        for r in e["decode"]:
            print(
                f"  context {r['context']:>7}: {r['ms_per_step']:7.2f} ms/step "
                f"({r['step_over_floor']:.2f}x the {r['floor_ms']:.2f} ms floor), "
                f"{r['tokens_per_step']:.2f} tokens/step, {r['ms_per_token']:.2f} ms/token"
            )


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="random:hf-llama-3.1-8b")
    p.add_argument("--drafters", nargs="+", default=["none", "random"])
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--budget", type=int, default=8192, help="prefill tokens per step")
    p.add_argument("--ttft-len", type=int, default=32768)
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131000])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="CPU dry run")
    p.add_argument("-o", "--output", type=Path,
                   default=Path(os.environ.get("OUT", ".")) / "long_context.json")  # fmt: skip
    args = p.parse_args()
    if args.tiny:
        args.model, args.draft_vocab, args.max_model_len = "random:tiny-llama", 256, 1024
        args.budget, args.ttft_len, args.contexts = 128, 300, [300, 900]
        args.decode_tokens, args.stream_tokens = 8, 8
    return args


def main() -> None:
    args = parse_args()
    rb.register_shapes()
    args.vocab = rb.model_config(args.model).vocab_size
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    bandwidth = bandwidth_bytes_per_s(device)
    out = {"model": args.model, "device": rb.device_name(device), "k": args.k,
           "bandwidth_tb_s": bandwidth / 1e12, "engines": []}  # fmt: skip
    for drafter in args.drafters:
        out["engines"].append(measure(args, drafter, bandwidth) | {"ttft_len": args.ttft_len})
        args.output.write_text(json.dumps(out, indent=1) + "\n")  # a timeout keeps what ran
    print_table(out)
    print("each engine warmed by untimed runs (its kernels compiled) before it was timed")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
