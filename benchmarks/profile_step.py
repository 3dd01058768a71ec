"""Kernel-level profile of single steps (torch.profiler, no Ray): for plain decoding and EAGLE-3,
graphed and eager, the prefill step and steady decode steps at each batch size: wall time per
step, GPU kernel time per step, kernels per step and the kernels that take the time. Prints a
table, writes JSON."""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

from benchmarks.kernel_profile import profiled_run  # noqa: E402
from deployments.prompt_sets import load_prompts  # noqa: E402
from speculative.config import EngineConfig, SamplingParams  # noqa: E402
from speculative.engine.llm_engine import LLMEngine, encode_prompt  # noqa: E402


def profiled(engine: LLMEngine, num_steps: int) -> dict:
    prof, wall = profiled_run(engine.step, engine.executor.device, num_steps)
    kernels = defaultdict(lambda: [0, 0.0])
    ops = 0  # top-level ATen ops: what the host dispatches one by one when not graphed
    for e in prof.events():
        if (
            e.device_type == DeviceType.CPU
            and e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
        ):
            ops += 1
        if e.device_type == DeviceType.CUDA:
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.time_range.elapsed_us()
    total_us = sum(t for _, t in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "wall_ms_per_step": wall * 1000 / num_steps,
        "kernel_ms_per_step": total_us / 1000 / num_steps,
        "kernels_per_step": sum(n for n, _ in kernels.values()) / num_steps,
        "host_ops_per_step": ops / num_steps,
        "top_kernels": [
            {"name": name[:90], "per_step": n / num_steps, "ms_per_step": t / 1000 / num_steps}
            for name, (n, t) in top
        ],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("--dataset")
    p.add_argument("--batch", default="1,8")
    p.add_argument("-k", type=int, default=3)
    p.add_argument(
        "--siblings", type=int, nargs="+", default=[0], help="draft_siblings of the EAGLE-3 runs"
    )
    p.add_argument("--modes", default="plain,eagle")
    p.add_argument("--graphs", choices=["on", "off", "both"], default="both")
    p.add_argument(
        "--top", type=int, default=0, help="print this many of each decode row's top kernels"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("-o", "--output", default="benchmarks/profile_step.json")
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    texts = load_prompts(args.dataset, max(batches))
    results = []
    modes = args.modes.split(",")
    runs = [("none", 0)] * ("plain" in modes) + [(args.drafter, m) for m in args.siblings] * (
        "eagle" in modes
    )
    for drafter, siblings in runs:
        for graphs in {"on": (True,), "off": (False,), "both": (True, False)}[args.graphs]:
            cfg = EngineConfig(
                model=args.model,
                drafter=drafter,
                num_draft_tokens=args.k,
                max_batch_size=max(batches),
                max_model_len=1024,
                device=args.device,
                cuda_graphs=graphs,
                overlap=False,
                draft_siblings=siblings,
            )
            engine = LLMEngine(cfg)
            prompts = [encode_prompt(engine.tokenizer, t) for t in texts]
            engine.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
            for batch in batches:
                for p_ids in prompts[:batch]:
                    engine.add_request(p_ids, SamplingParams(max_tokens=512, ignore_eos=True))
                prefill = profiled(engine, 1)
                for _ in range(3):
                    engine.step()
                decode = profiled(engine, args.steps)
                for r in list(engine.scheduler.running):
                    engine.abort(r)
                while engine.has_work:
                    engine.step()
                row = {
                    "mode": "plain" if drafter == "none" else "eagle",
                    "siblings": siblings,
                    "cuda_graphs": graphs,
                    "batch": batch,
                    "prefill": prefill,
                    "decode": decode,
                }
                results.append(row)
                for kind in ("prefill", "decode"):
                    r = row[kind]
                    print(
                        f"{row['mode']:5} M={siblings} graphs={str(graphs):5} b={batch:<3} "
                        f"{kind:7} wall {r['wall_ms_per_step']:7.2f} ms"
                        f"  kernels {r['kernel_ms_per_step']:7.2f} ms  "
                        f"{r['kernels_per_step']:6.0f} kernels/step"
                        f"  {r['host_ops_per_step']:6.0f} host ops/step"
                    )
                for kernel in decode["top_kernels"][: args.top]:
                    print(
                        f"    {kernel['ms_per_step']:6.3f} ms {kernel['per_step']:5.0f}x "
                        f"{kernel['name'][:70]}"
                    )
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {args.output}")


if __name__ == "__main__":
    main()
