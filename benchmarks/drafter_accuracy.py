"""A drafter's teacher-forced accuracy per draft depth on the target's own greedy responses (the
training objective's view: `ttt_forward` over the whole sequence, argmax against the target's,
rows whose target token is draftable), beside the engine's acceptance length on the same prompts.

If the two views agree, training and inference see the same drafter and acceptance is bounded by
what the drafter learned; if accuracy were high but acceptance low, inference would differ from
training. Besides the EAGLE sets, `train_seen` takes the first training prompts in the order the
default distillation uses (distilled and trained on) and `train_unseen` the last ones (never
distilled): the gap between the two is what the drafter memorised rather than generalised.

    python benchmarks/drafter_accuracy.py --device cpu --num-prompts 8 --max-tokens 128 -o FILE
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from acceptance import load_sets  # noqa: E402  (benchmarks/acceptance.py)
from speculative.config import EngineConfig, SamplingParams  # noqa: E402
from speculative.engine import LLMEngine, encode_prompt  # noqa: E402
from speculative.train.config import DistillConfig  # noqa: E402
from speculative.train.data import prompt_order, read_prompts  # noqa: E402
from speculative.train.target import target_draft_probs, target_features  # noqa: E402
from speculative.train.ttt import ttt_forward, ttt_loss  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def training_prompts(data_root: Path, n: int) -> tuple[list[str], list[str]]:
    """(first n, last n) prompts of at most 1500 characters in the default distillation order."""
    files = sorted(str(f) for f in (data_root / "train_prompts").glob("*.jsonl.gz")) + \
        [str(data_root / "gsm8k" / "train.jsonl.gz")]
    order = [t for t in prompt_order(read_prompts(files), DistillConfig(prompt_files=files)) if len(t) <= 1500]
    return order[:n], order[-n:]


@torch.no_grad()
def measure(engine: LLMEngine, texts: list[str], max_tokens: int, depths: int) -> dict:
    runner = engine.executor
    target, drafter = runner.target, runner.drafter
    draft_to_target = (torch.arange(drafter.cfg.draft_vocab_size, device=runner.device) + drafter.d2t).long()
    requests = engine.generate([encode_prompt(engine.tokenizer, t) for t in texts], SamplingParams(max_tokens=max_tokens))
    accuracies = []
    for r in requests:
        ids = torch.tensor([r.prompt_ids + r.output_ids], device=runner.device)
        hidden, aux = target_features(target, ids)
        probs, is_in_draft = target_draft_probs(target, hidden, draft_to_target)
        logits = ttt_forward(drafter, ids, aux, depths)
        _, accuracy = ttt_loss(logits, probs, is_in_draft, torch.tensor([ids.shape[1]], device=runner.device),
                               torch.tensor([len(r.prompt_ids)], device=runner.device), decay=1.0)
        accuracies.append(accuracy.cpu())
    steps = sum(r.num_verify_steps for r in requests)
    return {"accuracy_by_depth": [round(a, 4) for a in torch.stack(accuracies).mean(0).tolist()],
            "acceptance_length": round(sum(r.num_verify_emitted for r in requests) / max(steps, 1), 4)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("-k", type=int, default=3, help="draft tokens (the engine) and depths (the accuracy)")
    p.add_argument("--sets", nargs="+", default=["eagle_gsm8k", "eagle_alpaca", "eagle_sum", "eagle_qa",
                                                  "train_seen", "train_unseen"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--data-root", type=Path, default=DATA)
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, drafter=args.drafter, num_draft_tokens=args.k,
                                    max_batch_size=args.num_prompts, device=args.device, overlap=False))
    sets = load_sets(args.data_root, num_gsm8k_test=args.num_prompts)
    sets["train_seen"], sets["train_unseen"] = training_prompts(args.data_root, args.num_prompts)
    results = {name: measure(engine, sets[name][:args.num_prompts], args.max_tokens, args.k)
               for name in tqdm(args.sets, desc="sets")}
    print(f"{'set':14} {'accuracy by depth':>24} {'acc len':>8}")
    for name, r in results.items():
        print(f"{name:14} {' '.join(f'{a:.2f}' for a in r['accuracy_by_depth']):>24} {r['acceptance_length']:>8.2f}")
    if args.output:
        args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "sets": results}, indent=1))


if __name__ == "__main__":
    main()
