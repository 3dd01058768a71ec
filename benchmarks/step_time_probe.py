"""Host time per decode step on CPU: the in-process engine, eager, overlap off, one batch of
requests decoding together, median wall time of `engine.step()` once every request is running.
Uses only the engine's public API, so it runs on older commits too (benchmarks/ab_compare.py).

    python benchmarks/step_time_probe.py [--batch 8] [--k 5] [--drafter default] [--output F]
"""

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--drafter", default="default", help="'default', 'none' or a directory")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--output", type=Path, default=HERE / "step_time_probe.json")
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent))
    import torch

    from speculative.config import EngineConfig, SamplingParams
    from speculative.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    cfg = EngineConfig(
        drafter=args.drafter,
        num_draft_tokens=args.k,
        max_batch_size=args.batch,
        max_model_len=512,
        device="cpu",
        dtype="float32",
        overlap=False,
    )
    engine = LLMEngine(cfg)
    prompts = [[1 + (7 * i + j) % 4000 for j in range(24)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    step_ms, start = [], time.perf_counter()
    while engine.has_work:
        began = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - began) * 1000)
    seconds = time.perf_counter() - start
    outputs = [r.output_ids for r in requests]
    tokens = sum(map(len, outputs))
    result = {
        "batch": args.batch,
        "k": args.k,
        "drafter": args.drafter,
        "steps": len(step_ms),
        "median_step_ms": round(statistics.median(step_ms[2:]), 2),
        "tokens_per_s": round(tokens / seconds, 2),
        "output_sha1": hashlib.sha1(json.dumps(outputs).encode()).hexdigest()[:12],
    }
    args.output.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
