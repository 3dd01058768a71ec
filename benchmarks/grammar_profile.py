"""Where a constrained step's milliseconds go: torch.profiler (host with Python calls, and the GPU
where there is one) over steady decode steps of a batch of json_schema requests, plain and
speculative (SmolLM2, the overlapped loop in one process), warmed first. Per step: the host time
in each piece of the grammar work (the host's matchers advancing along the output, its masks
filled along the drafts, their rollbacks, the ranks' draft masks and their jump-forward, the late
masks written to the device), the Python around them, host-to-device copies, host syncs, and the
GPU's kernel time beside the step's wall time. Prints a table, writes JSON.

    python benchmarks/grammar_profile.py --device cpu --batch 8 --steps 10      # CPU
    python3 benchmarks/grammar_profile.py --device cuda --model $M --drafter $D  # GPU job
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.structured_speed import PERSON  # noqa: E402
from speculative.config import EngineConfig, SamplingParams, StructuredSpec  # noqa: E402
from speculative.engine.llm_engine import LLMEngine, encode_prompt  # noqa: E402

# piece -> patterns of the Python calls it is made of (file and function), first match wins;
# a call inside another call of the same piece is counted once, but a piece's time includes the
# other pieces it calls (a rollback inside a mask fill counts in both)
PIECES = [
    ("matcher advance (host)", ("speculative/grammar.py(", ": accept"),
     ("xgrammar/matcher.py(", ": accept_token")),
    ("mask fill (host)", ("speculative/grammar.py(", ": fill"),
     ("xgrammar/matcher.py(", ": fill_next_token_bitmask")),
    ("rollback (host)", ("xgrammar/matcher.py(", ": rollback"),),
    ("jump-forward (ranks)", ("xgrammar/matcher.py(", ": find_jump_forward"),),
    ("draft masks (ranks)", ("workers/draft_grammar.py(", ""),),
    ("late masks to device", ("workers/late_grammar.py(", ""),),
    ("plan and results (host)", ("speculative/engine/scheduler.py(", ": plan"),
     ("speculative/engine/scheduler.py(", ": process")),
]  # fmt: skip
SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def piece_of(name: str) -> str | None:
    for piece, *patterns in PIECES:
        if any(a in name and b in name for a, b in patterns):
            return piece
    return None


def classify(prof, steps: int, cuda: bool) -> dict:
    """-> {piece: host us a step} plus copies, syncs and the GPU's kernel us a step."""
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            out["GPU kernels"] += e.device_time
            continue
        piece = piece_of(e.name)
        parent = e.cpu_parent
        while parent is not None and piece is not None:
            if piece_of(parent.name) == piece:
                piece = None  # inside a call of its own piece: counted there
            parent = parent.cpu_parent
        if piece is not None:
            out[piece] += e.cpu_time_total
        if e.name == "cudaMemcpyAsync" or (not cuda and e.name == "aten::copy_"):
            out["host-to-device copies (launch)"] += e.cpu_time_total
        if e.name in SYNCS or e.name == "aten::item":
            out["host syncs"] += e.cpu_time_total
    return {k: v / steps for k, v in out.items()}


def run(engine, prompts, params, steps: int, cuda: bool) -> dict:
    """Warm (grammar compiled, graphs and kernels used), then `steps` steady steps profiled."""
    engine.generate(prompts[:2], params.model_copy(update={"max_tokens": 8}))
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(4):  # every request admitted and decoding
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6 / steps
    while engine.has_work:
        engine.step()
    return {"wall us a step": wall_us} | classify(prof, steps, cuda)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("-o", "--output", default="benchmarks/grammar_profile.json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    params = SamplingParams(
        max_tokens=128, structured=StructuredSpec(kind="json", spec=json.dumps(PERSON))
    )
    results = {}
    for mode, drafter in (("plain", "none"), ("speculative", args.drafter)):
        cfg = EngineConfig(model=args.model, drafter=drafter, num_draft_tokens=args.k,
                           device=args.device, max_batch_size=args.batch, max_model_len=1024,
                           kv_cache_memory_gb=1.0 if cuda else None)  # fmt: skip
        engine = LLMEngine(cfg)
        questions = [f"Describe person number {i} as JSON." for i in range(args.batch)]
        prompts = [encode_prompt(engine.tokenizer, q) for q in questions]
        results[mode] = run(engine, prompts, params, args.steps, cuda)
        del engine
    rows = sorted(
        {k for r in results.values() for k in r}, key=lambda k: -results["plain"].get(k, 0)
    )
    print(f"json_schema, batch {args.batch}, {args.device}: microseconds a step (warmed)")
    print(f"{'':<34}{'plain':>12}{'speculative':>14}")
    for k in rows:
        print(
            f"{k:<34}{results['plain'].get(k, 0):>12.0f}{results['speculative'].get(k, 0):>14.0f}"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(vars(args) | {"results": results}, indent=1))
    print("wrote", args.output)


if __name__ == "__main__":
    main()
