"""Which prompt-lookup rule drafts best: acceptance length (K draft tokens, greedy) of several rules
for choosing between the drafter's own draft and a looked-up one, side by side in one run on the
same engine and prompts. A rule replaces `ModelRunner._propose`; everything else is the engine's.

Rules (`name:params`):
  off             the drafter alone
  p:P:N           the engine's rule (N=5): the looked-up token (match of N tokens) where the
                  drafter's own draft has probability below P
  boost:A:N       the looked-up token where the drafter gives it at least 1/A of its own draft's
                  probability (A=1: only where it is the drafter's own draft too; a token outside
                  the draft vocabulary has probability 0 and is never taken)
  longest:P       like p:P, but the longest match of 4, 3 or 2 tokens
  recent:P:N:W    like p:P:N, but only while the request is copying: where the lookup would have
                  predicted at least one of the W tokens before this one

    python benchmarks/lookup_policies.py --device cpu --rules off p:0.8:4 p:0.8:3 boost:4:3 \
        --sets sum alpaca -o FILE
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from acceptance import EAGLE_SETS, load_sets, measure  # noqa: E402  (benchmarks/acceptance.py)

from speculative.config import EngineConfig  # noqa: E402
from speculative.engine.llm_engine import LLMEngine, encode_prompt  # noqa: E402
from speculative.prompt_lookup import lookup  # noqa: E402


def make_rule(runner, spec: str):
    """The `_propose(h, slots, q, depth)` of a rule spec (see the module docstring); no draft
    tree."""
    name, *params = spec.split(":")
    drafter = runner.drafter
    # target id -> draft id (draft ids keep the target's order); -1 outside the draft vocabulary
    target_to_draft = torch.where(drafter.t2d, drafter.t2d.long().cumsum(0) - 1, -1)

    def propose(h, slots, q, depth):
        if name == "off":
            return drafter.propose(h)[:, 0]
        draft, probability = (t[:, 0] for t in drafter.propose_scored(h))
        history = runner.state.history[slots]
        if name == "longest":
            found, copied = lookup(history, q, 2)
            for n in (3, 4):  # a longer match overrides a shorter one
                longer, token = lookup(history, q, n)
                found, copied = found | longer, torch.where(longer, token, copied)
            use = found & (probability < float(params[0]))
        else:
            found, copied = lookup(history, q, int(params[1]))
            if name == "p":
                use = found & (probability < float(params[0]))
            elif name == "recent":
                hits = torch.zeros_like(found)
                for back in range(1, int(params[2]) + 1):  # lookup at j predicts the token at j+2
                    j = (q - back).clamp(min=0)
                    was_found, predicted = lookup(history, j, int(params[1]))
                    actual = history.gather(1, (j + 2).unsqueeze(1))[:, 0]
                    hits |= was_found & (predicted == actual) & (q - back >= 0)
                use = found & hits & (probability < float(params[0]))
            elif name == "boost":
                index = target_to_draft[copied]
                probs = drafter.lm_head(drafter.norm(h)).float().softmax(-1)  # [B, draft vocab]
                p_copied = probs.gather(1, index.clamp(min=0).unsqueeze(1))[:, 0] * (index >= 0)
                use = found & (p_copied * float(params[0]) >= probability)
            else:
                raise ValueError(f"unknown rule {spec!r}")
        draft = torch.where(use, copied, draft)
        runner.state.record(slots, (q + 2).unsqueeze(1), draft.unsqueeze(1))
        return draft

    return propose


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="default")
    p.add_argument("-k", type=int, default=3)
    p.add_argument(
        "--rules", nargs="+", default=["off", "p:0.8:4", "p:0.8:3", "boost:4:3", "longest:0.8"]
    )
    p.add_argument("--sets", nargs="+", default=list(EAGLE_SETS), choices=EAGLE_SETS)
    p.add_argument("--num-prompts", type=int, default=80, help="first N prompts of each set")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-batch-size", type=int, default=80)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)
    # prompt_lookup > 0 so that the runner keeps the token history; the rules decide the rest. No
    # CUDA graphs: they would keep the `_propose` they were captured with
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            drafter=args.drafter,
            num_draft_tokens=args.k,
            max_batch_size=args.max_batch_size,
            max_model_len=2048,
            max_num_batched_tokens=16384,
            device=args.device,
            prompt_lookup=1.0,
            cuda_graphs=False,
        )
    )
    engine.scheduler.tokenizer = None
    runner = engine.executor
    sets = {
        name: [encode_prompt(engine.tokenizer, t) for t in texts[: args.num_prompts]]
        for name, texts in load_sets(0, args.sets).items()
    }
    results = []
    for rule in args.rules:
        runner.proposer.propose = make_rule(runner, rule)
        for name, prompts in sets.items():
            row = {"rule": rule, "set": name, **measure(engine, prompts, 0.0, args.max_tokens)}
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    names = list(sets)
    print(
        f"acceptance length, K={args.k} greedy, {args.num_prompts} prompts a set, "
        f"{args.max_tokens} tokens"
    )
    print("| rule | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for rule in args.rules:
        cells = {r["set"]: r["acceptance_length"] for r in results if r["rule"] == rule}
        print(f"| {rule} | " + " | ".join(f"{cells[n]:.3f}" for n in names) + " |")
    if args.output:
        args.output.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
