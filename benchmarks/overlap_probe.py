"""Why EAGLE-3 with overlap is slower than without at batch 8 (issue 6): the same load with overlap
on and off, (1) in one process (LLMEngine over a local ModelRunner: no Ray, no threads) and
(2) on the Ray path, with rank 0 under torch.profiler (EAGLESERVE_TORCH_PROFILER_DIR). Prints
tokens/s and host launch time per step; writes JSON with the host-op tables, and the Ray workers'
chrome traces."""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from deployments.bench import load_prompts, run_load
from speculative.config import EngineConfig, SamplingParams
from speculative.engine.llm_engine import LLMEngine, encode_prompt

CUDA = torch.cuda.is_available()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def in_process(
    cfg: EngineConfig, texts: list[str], batch: int, output_len: int, steps: int
) -> list[dict]:
    engine = LLMEngine(cfg)
    prompts = [encode_prompt(engine.tokenizer, t) for t in texts]
    launch_s = []
    execute = engine.executor.execute

    def timed(plan):
        start = time.perf_counter()
        handle = execute(plan)
        launch_s.append(time.perf_counter() - start)
        return handle

    engine.executor.execute = timed
    engine.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
    rows = []
    for overlap in (False, True):
        engine.overlap = overlap
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        for p in prompts[:batch]:
            engine.add_request(p, params)
        for _ in range(20):  # past the prefill, into steady decode
            engine.step()
        launch_s.clear()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        launch = list(launch_s)
        with profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        ) as prof:
            for _ in range(20):
                engine.step()
            sync()
        ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        for r in list(engine.scheduler.running):
            engine.abort(r)
        while engine.has_work:
            engine.step()
        rows.append(
            {
                "path": "in-process",
                "mode": "plain" if cfg.drafter == "none" else "eagle",
                "overlap": overlap,
                "ms_per_step": wall * 1000 / steps,
                "launch_ms": float(np.mean(launch) * 1000),
                "ops": ops,
            }
        )
        print_row(rows[-1])
    return rows


def ray_path(cfg: EngineConfig, texts: list[str], batch: int, output_len: int) -> list[dict]:
    from speculative.engine.coordinator import Coordinator

    rows = []
    for overlap in (True, False):
        coordinator = Coordinator(cfg.model_copy(update={"overlap": overlap}))
        try:
            pid = __import__("ray").get(coordinator.executor.workers[0].process_info.remote())[
                "pid"
            ]
            prompts = [encode_prompt(coordinator.tokenizer, t) for t in texts]
            params = SamplingParams(max_tokens=output_len, ignore_eos=True)
            coordinator.executor.trace = []
            load = run_load(coordinator, prompts[: 2 * batch], params, batch)
            trace = coordinator.executor.trace
            decode = [t for t in trace if not t["num_prefills"]]
            rows.append(
                {
                    "path": "ray",
                    "mode": "plain" if cfg.drafter == "none" else "eagle",
                    "overlap": overlap,
                    "ms_per_step": load["wall_s"] * 1000 / len(trace),
                    "launch_ms": float(
                        np.mean([t["launched_at"] - t["received_at"] for t in decode]) * 1000
                    ),
                    "tokens_per_s": load["output_tokens_per_s"],
                    "ops": f"ray/worker-{pid}.ops.txt",
                }
            )
            print_row(rows[-1])
        finally:
            coordinator.shutdown()
    return rows


def print_row(r: dict) -> None:
    print(
        f"{r['path']:10} {r['mode']:5} overlap={r['overlap']!s:5} {r['ms_per_step']:7.2f} ms/step "
        f"launch {r['launch_ms']:6.2f} ms",
        flush=True,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("--dataset")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("-o", "--output", default="benchmarks/overlap_probe")
    args = p.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    texts = load_prompts(args.dataset, 2 * args.batch)
    rows = []
    for drafter in (args.drafter, "none"):
        cfg = EngineConfig(
            model=args.model,
            drafter=drafter,
            num_draft_tokens=args.k,
            max_batch_size=args.batch,
            max_model_len=1024,
            device=args.device,
        )
        rows += in_process(cfg, texts, args.batch, args.output_len, args.steps)
    os.environ["EAGLESERVE_TORCH_PROFILER_DIR"] = str(
        (out / "ray").resolve()
    )  # inherited by the workers
    import ray

    ray.init(include_dashboard=False, num_cpus=4, log_to_driver=False)
    cfg = EngineConfig(
        model=args.model,
        drafter=args.drafter,
        num_draft_tokens=args.k,
        max_batch_size=args.batch,
        max_model_len=1024,
        device=args.device,
    )
    rows += ray_path(cfg, texts, args.batch, args.output_len)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
