"""Where greedy drafts miss, and why. Two views of one drafter on the same requests, per set:

1. The engine's view. For each verify step that rejects a draft, the target token at the first
   rejected position is classed as outside the draft vocabulary (never draftable), copyable (the
   pair of it and the token before it occurs in the prompt, as prompt-lookup decoding would find
   it), or other; with the share of steps whose first draft is accepted and the acceptance length.
2. The training objective's view: teacher-forced accuracy per draft depth (`train_step` over the
   whole prompt + response, argmax against the target's, over rows whose target token is
   draftable). If the views disagree, inference does not run the drafter that training made.

Besides the EAGLE sets, `train_seen` takes the first training prompts of the default distillation
order (distilled and trained on) and `train_unseen` the last ones (never distilled): the gap
between them is what the drafter memorised rather than learned. `train_long_seen` and
`train_long_unseen` do the same for long inputs (2000-5000 characters), like the sum set's. Runs
the in-process engine without overlap, so the drafts a step verifies can be read from the
worker's slot state.

    python benchmarks/draft_misses.py --device cpu --num-prompts 8 --max-tokens 128 -o FILE
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from acceptance import load_sets  # noqa: E402  (benchmarks/acceptance.py)

from speculative.config import EngineConfig, SamplingParams  # noqa: E402
from speculative.engine.llm_engine import LLMEngine, encode_prompt  # noqa: E402
from speculative.train.config import DistillConfig, TrainConfig  # noqa: E402
from speculative.train.data import prompt_order, read_prompts  # noqa: E402
from speculative.train.trainer import train_step  # noqa: E402


def training_order(data_root: Path) -> list[str]:
    """The training prompts in the default distillation order."""
    files = sorted(str(f) for f in (data_root / "train_prompts").glob("*.jsonl.gz")) + [
        str(data_root / "gsm8k" / "train.jsonl.gz")
    ]
    return prompt_order(read_prompts(files), DistillConfig(prompt_files=files))


def first_and_last(order: list[str], n: int, chars: tuple[int, int]) -> tuple[list[str], list[str]]:
    """(first n, last n) prompts of `order` whose length in characters is within `chars`."""
    kept = [t for t in order if chars[0] <= len(t) <= chars[1]]
    return kept[:n], kept[-n:]


def misses(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[Counter, list]:
    """Counts of verify steps, first-draft hits and misses by class; the finished requests."""
    runner, K = engine.executor, engine.cfg.k
    in_vocab = runner.drafter.t2d.cpu()
    requests = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    prompt_pairs = {r.request_id: set(zip(r.prompt_ids, r.prompt_ids[1:])) for r in requests}
    counts = Counter()
    while engine.has_work:
        verifying = [
            (r, r.num_verify_steps, runner.state.drafts[r.slot, :K].tolist())
            for r in requests
            if r.slot is not None and not r.is_finished and r.output_ids
        ]
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
            at = len(sequence) - len(tokens) + missed_at  # the miss's position in the sequence
            pair = (sequence[at - 1], sequence[at])
            kind = (
                "not_in_draft_vocab"
                if not in_vocab[pair[1]]
                else "copyable"
                if pair in prompt_pairs[r.request_id]
                else "other"
            )
            counts[f"miss_{kind}"] += 1
    counts["verify_steps"] = sum(r.num_verify_steps for r in requests)
    counts["verify_emitted"] = sum(r.num_verify_emitted for r in requests)
    return counts, requests


@torch.no_grad()
def teacher_forced_accuracy(engine: LLMEngine, requests: list, depths: int) -> list[float]:
    runner = engine.executor
    drafter = runner.drafter
    draft_to_target = (
        torch.arange(drafter.cfg.draft_vocab_size, device=runner.device) + drafter.d2t
    ).long()
    cfg = TrainConfig(
        model="unused", output="unused", data="unused", ttt_steps=depths, step_decay=1.0
    )
    accuracies = []
    for r in requests:
        batch = (
            torch.tensor([r.prompt_ids + r.output_ids]),
            torch.tensor([len(r.prompt_ids) + len(r.output_ids)]),
            torch.tensor([len(r.prompt_ids)]),
        )
        _, accuracy = train_step(
            cfg, runner.target, drafter, draft_to_target, batch, runner.device, torch.float32
        )
        accuracies.append(accuracy.cpu())
    return [round(a, 4) for a in torch.stack(accuracies).mean(0).tolist()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument(
        "-k", type=int, default=3, help="draft tokens (the engine) and depths (the accuracy)"
    )
    p.add_argument(
        "--sets",
        nargs="+",
        default=[
            "gsm8k",
            "alpaca",
            "sum",
            "qa",
            "train_seen",
            "train_unseen",
            "train_long_seen",
            "train_long_unseen",
        ],
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--prompt-lookup", type=float, default=0.0, help="EngineConfig.prompt_lookup (0: off)"
    )
    p.add_argument(
        "--data-root",
        type=Path,
        required=True,
        help="folder with train_prompts/ and gsm8k/train.jsonl.gz (not shipped: training data)",
    )
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            drafter=args.drafter,
            num_draft_tokens=args.k,
            max_batch_size=args.num_prompts,
            device=args.device,
            overlap=False,
            prompt_lookup=args.prompt_lookup,
        )
    )
    sets = {name.removeprefix("eagle_"): texts for name, texts in load_sets(0).items()}
    order = training_order(args.data_root)
    sets["train_seen"], sets["train_unseen"] = first_and_last(order, args.num_prompts, (0, 1500))
    # long inputs (~500-1500 tokens), like the sum set's articles; 3% of the training prompts
    sets["train_long_seen"], sets["train_long_unseen"] = first_and_last(
        order, args.num_prompts, (2000, 5000)
    )
    results = {}
    for name in tqdm(args.sets, desc="sets"):
        prompts = [encode_prompt(engine.tokenizer, q) for q in sets[name][: args.num_prompts]]
        counts, requests = misses(engine, prompts, args.max_tokens)
        results[name] = dict(
            counts, accuracy_by_depth=teacher_forced_accuracy(engine, requests, args.k)
        )
    kinds = ("not_in_draft_vocab", "copyable", "other")
    print(
        f"{'set':17} {'acc len':>7} {'draft 1 hit':>11} {'misses':>7} {'not in vocab':>12} "
        f"{'copyable':>9} "
        f"{'other':>6}  accuracy by depth"
    )
    for name, c in results.items():
        total = sum(c.get(f"miss_{k}", 0) for k in kinds)
        share = {k: c.get(f"miss_{k}", 0) / max(total, 1) for k in kinds}
        print(
            f"{name:17} {c['verify_emitted'] / max(c['verify_steps'], 1):>7.2f} "
            f"{c['first_draft_hit'] / max(c['steps'], 1):>11.2f} {total:>7} "
            f"{share['not_in_draft_vocab']:>12.1%} "
            f"{share['copyable']:>9.1%} {share['other']:>6.1%}  "
            f"{' '.join(f'{a:.2f}' for a in c['accuracy_by_depth'])}"
        )
    if args.output:
        args.output.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "sets": results}, indent=1
            )
        )


if __name__ == "__main__":
    main()
