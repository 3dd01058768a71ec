"""Where greedy drafts miss: for each verify step that rejects a draft, the target token at the first
rejected position is classed as outside the draft vocabulary (never draftable), copyable (the pair
of it and the token before it occurs in the prompt, as prompt-lookup decoding would find it), or
other; per set, with the share of steps whose first draft is accepted.
Runs the in-process engine without overlap, so the drafts a step verifies can be read from the
worker's slot state just before it.

    python benchmarks/draft_misses.py --sets sum qa gsm8k --num-prompts 8 --max-tokens 96 --device cpu
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from acceptance import load_sets  # noqa: E402  (benchmarks/acceptance.py)
from speculative.config import EngineConfig, SamplingParams  # noqa: E402
from speculative.engine import LLMEngine, encode_prompt  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def misses(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> Counter:
    """Counts of verify steps, first-draft hits and misses by class."""
    runner, K = engine.executor, engine.cfg.k
    in_vocab = runner.drafter.t2d.cpu()
    requests = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    prompt_pairs = {r.request_id: set(zip(r.prompt_ids, r.prompt_ids[1:])) for r in requests}
    counts = Counter()
    while engine.has_work:
        verifying = [(r, r.num_verify_steps, runner.drafts[r.slot, :K].tolist())
                     for r in requests if r.slot is not None and not r.is_finished and r.output_ids]
        emitted = {o.request_id: o.new_token_ids for o in engine.step()}
        for r, steps_before, drafts in verifying:
            tokens = emitted.get(r.request_id)
            if r.num_verify_steps == steps_before or not tokens:
                continue
            # the first emitted token that differs from its draft is the target's: the miss
            # (none: every draft accepted, or the request ended before the first rejection)
            missed_at = next((i for i, (d, t) in enumerate(zip(drafts, tokens)) if d != t), None)
            counts["steps"] += 1
            counts["first_draft_hit"] += missed_at != 0
            if missed_at is None:
                continue
            sequence = r.prompt_ids + r.output_ids
            at = len(sequence) - len(tokens) + missed_at          # the miss's position in the sequence
            pair = (sequence[at - 1], sequence[at])
            kind = "not_in_draft_vocab" if not in_vocab[pair[1]] else \
                "copyable" if pair in prompt_pairs[r.request_id] else "other"
            counts[f"miss_{kind}"] += 1
    return counts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--sets", nargs="+", default=["gsm8k", "alpaca", "sum", "qa"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--data-root", type=Path, default=DATA)
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, drafter=args.drafter, num_draft_tokens=args.k,
                                    max_batch_size=args.num_prompts, device=args.device, overlap=False))
    sets = load_sets(args.data_root, num_gsm8k_test=0)
    results = {}
    for name in tqdm(args.sets, desc="sets"):
        prompts = [encode_prompt(engine.tokenizer, q) for q in sets[f"eagle_{name}"][:args.num_prompts]]
        results[name] = dict(misses(engine, prompts, args.max_tokens))
    kinds = ("not_in_draft_vocab", "copyable", "other")
    print(f"{'set':8} {'steps':>6} {'draft 1 hit':>11} {'misses':>7} {'not in vocab':>12} {'copyable':>9} {'other':>6}")
    for name, c in results.items():
        total = sum(c.get(f"miss_{k}", 0) for k in kinds)
        share = {k: c.get(f"miss_{k}", 0) / max(total, 1) for k in kinds}
        print(f"{name:8} {c['steps']:>6} {c['first_draft_hit'] / max(c['steps'], 1):>11.2f} {total:>7} "
              f"{share['not_in_draft_vocab']:>12.1%} {share['copyable']:>9.1%} {share['other']:>6.1%}")
    if args.output:
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "sets": results}, indent=1))


if __name__ == "__main__":
    main()
