"""The target families at their 8B shapes on the paged engine, random weights, one at a time:
Llama-3.1-8B, Qwen2.5-7B and Qwen3-8B (their config.json shapes: benchmarks/runner_bench.py).
For each, CUDA graphs on and off:
- greedy outputs of a few prompts through LLMEngine, plain decoding and EAGLE-3 with a random
  drafter (K=5), graphed against eager token for token, in float32 and bf16. In float32 graphs
  and eager run the same kernels and must agree. In bf16 the graphs run cuDNN's GQA attention
  and eager the folded memory-efficient kernel, so where two random logits nearly tie the
  argmax may legitimately differ: the first differing position is reported, not hidden.
- the decode step at batch 1 and 8 (bf16, 512 KV rows a row): plain decoding and the
  speculative step, ms per step back to back, graphed and eager.
Prints a table, writes JSON (default $OUT/families_gpu.json).

    python3 benchmarks/families_gpu.py          # on a GPU (about 2-3 minutes)
    python3 benchmarks/families_gpu.py --tiny   # CPU dry run: tiny models of each family
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import runner_bench as rb  # noqa: E402
from speculative.config import EngineConfig, SamplingParams  # noqa: E402
from speculative.engine.llm_engine import LLMEngine  # noqa: E402
from workers.cuda_graphs import StepGraphSet  # noqa: E402
from workers.device import pick_device  # noqa: E402

FAMILIES = ["hf-llama-3.1-8b", "hf-qwen2.5-7b", "hf-qwen3-8b"]


def engine_config(args, family: str, dtype: str, drafter: str) -> EngineConfig:
    """Prefix caching off: the graphed run recomputes the prompts the eager run computed."""
    max_len = args.context + 64 if dtype == args.dtypes[0] else 128  # 128: the checks alone
    max_batch = max(args.batch + [args.num_prompts])
    model_cfg = rb.model_config(f"random:{family}")
    per_token = rb.kv_bytes_per_token(model_cfg, getattr(torch, dtype), True)
    kv_gib = per_token * max_batch * (max_len + 64) / 2**30
    return EngineConfig(
        model=f"random:{family}", drafter=drafter, num_draft_tokens=args.k,
        max_batch_size=max_batch, max_model_len=max_len, kv_cache_memory_gb=kv_gib,
        enable_prefix_caching=False, device=args.device, dtype=dtype,
    )  # fmt: skip


def make_prompts(vocab: int, num: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab, (num, length), generator=g).tolist()


def generate(engine: LLMEngine, prompts, max_tokens: int, graphs: StepGraphSet) -> list:
    """Greedy outputs with the runner's graphs set to `graphs` (an empty set: eager)."""
    engine.executor.graphs = graphs
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, params)]


def first_mismatches(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where the two outputs differ (None: identical)."""
    firsts = []
    for x, y in zip(a, b):
        diff = [i for i, (s, t) in enumerate(zip(x, y)) if s != t]
        firsts.append(diff[0] if diff else None if len(x) == len(y) else min(len(x), len(y)))
    return firsts


def step_times(args, runner) -> dict:
    """ms per decode step at each batch, graphed and eager (the same runner, graphs set aside)."""
    graphs, times = runner.graphs, {}
    for mode, graph_set in (("graphs", graphs), ("eager", StepGraphSet())):
        runner.graphs = graph_set
        for batch in args.batch:
            times[f"{mode}/b{batch}"] = rb.time_decode(runner, batch, args.context, args.repeats)
    runner.graphs = graphs
    return times


def check(args, family: str, dtype: str, drafter: str, prompts) -> dict:
    cfg = engine_config(args, family, dtype, drafter)
    runner = rb.build_runner(cfg, graphs=True)
    graphs = runner.graphs
    out = {"graphs_captured": graphs.verify is not None}
    if dtype == args.dtypes[0]:
        out["step"] = step_times(args, runner)
    engine = LLMEngine(cfg, executor=runner)
    eager = generate(engine, prompts, args.max_tokens, StepGraphSet())
    graphed = generate(engine, prompts, args.max_tokens, graphs)
    out |= {"graphs_equal_eager": graphed == eager,
            "first_mismatch": first_mismatches(eager, graphed), "eager_ids": eager,
            "graphed_ids": graphed}  # fmt: skip
    return out


def run_family(args, family: str) -> dict:
    prompts = make_prompts(rb.SHAPES[family]["vocab_size"], args.num_prompts, args.prompt_len)
    result = {}
    for dtype in args.dtypes:
        for drafter in ("none", "random"):
            result[f"{dtype}/{drafter}"] = check(args, family, dtype, drafter, prompts)
            rb.free_memory()
        plain, spec = result[f"{dtype}/none"], result[f"{dtype}/random"]
        result[f"{dtype}/spec_equals_plain"] = spec["eager_ids"] == plain["eager_ids"]
    return result


def print_table(out: dict) -> None:
    print(f"{'family':<17} {'run':<17} {'graphs=eager':>12} {'first mismatch':>16} "
          f"{'step ms graphs / eager':>30}")  # fmt: skip
    for family, result in out["families"].items():
        for key, r in result.items():
            if not isinstance(r, dict):
                print(f"{family:<17} {key:<17} {str(r):>12}")
                continue
            firsts = ",".join("-" if i is None else str(i) for i in r["first_mismatch"])
            step = r.get("step", {})
            times = " ".join(
                f"b{b} {step[f'graphs/b{b}']['step_ms']:.2f}/{step[f'eager/b{b}']['step_ms']:.2f}"
                for b in out["batch"]
                if step
            )
            print(f"{family:<17} {key:<17} {str(r['graphs_equal_eager']):>12} {firsts:>16} "
                  f"{times:>30}")  # fmt: skip


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", nargs="+", default=FAMILIES, choices=sorted(rb.SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                   help="the first is also timed")  # fmt: skip
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=512, help="KV rows of the timed steps")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: tiny models, float32")
    default_out = Path(os.environ.get("OUT", ".")) / "families_gpu.json"
    p.add_argument("-o", "--output", type=Path, default=default_out)
    args = p.parse_args()
    if args.tiny:
        args.families = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
        args.dtypes, args.batch, args.context, args.repeats = ["float32"], [1, 2], 256, 2
    return args


def main() -> None:
    args = parse_args()
    rb.register_shapes()
    device = pick_device(args.device)
    out = {"device": rb.device_name(device), "k": args.k, "batch": args.batch,
           "context": args.context, "max_tokens": args.max_tokens, "families": {}}  # fmt: skip
    for family in rb.progress(args.families, "families", "family"):
        out["families"][family] = run_family(args, family)
        out["peak_memory_gib"] = rb.peak_memory_gib(device)
        # after each family: a timeout keeps what ran
        args.output.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out)
    if device.type != "cuda":
        print("(no GPU: no graphs were captured, both columns ran the eager path)")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
