"""How well `--init-from` starts when the draft vocabulary grows: teacher-forced accuracy per depth
on the last few distilled sequences, before any training step, of the source drafter, of the grown
one as `init_drafter` makes it (the rows of new tokens: the target's rows through the affine map
fitted to the source's rows), and of the grown one with the target's rows as they are. CPU, fp32.

    python benchmarks/init_from_probe.py --source DIR --data DIR [--vocab 24576] -o FILE
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from speculative.drafter_format import load_drafter
from speculative.train.config import TrainConfig  # noqa: E402
from speculative.train.data import collate, load_data  # noqa: E402
from speculative.train.trainer import init_drafter, load_target, train_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--source", required=True, help="drafter to grow from")
    p.add_argument("--data", required=True, help="directory of distilled parts")
    p.add_argument("--vocab", type=int, default=24576, help="draft vocabulary size to grow to")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sequences", type=int, default=6)
    p.add_argument("-o", "--output", type=Path, required=True)
    args = p.parse_args()
    cfg = TrainConfig(
        model=args.model,
        output="unused",
        data=args.data,
        draft_vocab_size=args.vocab,
        ttt_steps=3,
        device="cpu",
    )
    store = load_data(cfg.data_dir)
    target = load_target(args.model, torch.device("cpu"), torch.float32)
    # the last sequences: distilled last, so a source trained on earlier data has not seen them
    batch = collate(store, list(range(len(store) - args.sequences, len(store))), 1024)

    def accuracy(drafter) -> list[float]:
        draft_to_target = (torch.arange(drafter.cfg.draft_vocab_size) + drafter.d2t).long()
        with torch.no_grad():
            _, acc = train_step(
                cfg, target, drafter, draft_to_target, batch, torch.device("cpu"), torch.float32
            )
        return [round(float(a), 3) for a in acc]

    source = load_drafter(Path(args.source), target_embeddings=target.embed_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        grown = init_drafter(
            cfg.model_copy(update={"init_from": args.source}), target, store, Path(tmp)
        )
    rows = {"source": accuracy(source), "grown, affine map (init_drafter)": accuracy(grown)}
    ids = (torch.arange(args.vocab) + grown.d2t).long()
    is_new = ~source.t2d.bool()[ids]
    with torch.no_grad():
        grown.lm_head.weight[is_new] = target.lm_head.weight[ids[is_new]]
    rows["grown, the target's rows as they are"] = accuracy(grown)
    print(f"{'drafter':<36} accuracy by depth (teacher-forced, {args.sequences} sequences)")
    for name, acc in rows.items():
        print(f"{name:<36} {' '.join(f'{a:.3f}' for a in acc)}")
    args.output.write_text(
        json.dumps(
            {
                "source": args.source,
                "vocab": args.vocab,
                "new_rows": int(is_new.sum()),
                "accuracy_by_depth": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
