"""An engine's start-up: how long it takes, how many CUDA graphs it captures, and their memory
(measured at the capture, and the estimate the pool was sized with where the tree makes one),
at the default sizing (gpu_memory_utilization, 256 request slots on CUDA). Run it from the root
of the tree to measure (benchmarks/gpu/graph_startup_job.sh runs it on the base tree and this
one); then one short greedy generation checks the engine works.

    python3 benchmarks/graph_startup.py --name head --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --drafter speculative/drafters/smollm2-135m --out $OUT/graph_startup_head.json
    python benchmarks/graph_startup.py --device cpu --max-model-len 512   # a CPU dry run
"""

import argparse
import json
import time

import torch

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.llm_engine import LLMEngine, encode_prompt


def start(args) -> tuple[LLMEngine, float]:
    cfg = EngineConfig(
        model=args.model,
        drafter=args.drafter,
        num_draft_tokens=3,
        max_model_len=args.max_model_len,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    began = time.perf_counter()
    engine = LLMEngine(cfg)
    return engine, time.perf_counter() - began


def graph_figures(runner) -> dict:
    graphs = runner.graphs
    step = [g for g in (graphs.verify, graphs.target_pass, graphs.chain) if g is not None]
    return {
        "num_graphs": sum(len(g.graphs) for g in graphs.all()),
        "num_step_graphs": sum(len(g.graphs) for g in step),
        "num_batch_buckets": len(step[0].batch_buckets) if step else 0,
        "graph_mib": graphs.pool_bytes / 2**20,
        # trees that size the pool by capturing the graphs once more have no estimate
        "graph_estimate_mib": getattr(graphs, "estimated_bytes", 0) / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="head")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--out", default="benchmarks/graph_startup.json")
    args = p.parse_args()
    engine, start_s = start(args)
    runner = engine.executor
    row = {"name": args.name, "start_s": start_s, "num_blocks": runner.num_blocks}
    row |= {"num_slots": runner.num_slots, **graph_figures(runner)}
    prompt = encode_prompt(engine.tokenizer, "What is the capital of Japan?")
    began = time.perf_counter()
    output = engine.generate([prompt], SamplingParams(max_tokens=32))[0].output_ids
    row |= {"generate_s": time.perf_counter() - began, "num_output_tokens": len(output)}
    if torch.cuda.is_available():
        row["device"] = torch.cuda.get_device_name()
    json.dump(row, open(args.out, "w"), indent=1)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
