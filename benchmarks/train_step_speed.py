"""Drafter training steps per second, two ways on the same batches in one run: the LM heads (the
target's draft-vocabulary distributions, the drafter's at every depth) and the loss over every
row of the batch, as training ran before commit 9579d71, and over only the rows that carry weight
(`loss_rows`: prompt rows and padding skipped), as it runs now. A step is the whole `train_step`
(target recompute, TTT forward, loss) plus backward and the optimizer. Batches are GSM8K training
questions (chat template) with their reference answers as responses, or distilled parts with --data.

    python benchmarks/train_step_speed.py --device cpu --data DIR --batch-tokens 2048 --steps 6 \
        -o FILE
    python benchmarks/train_step_speed.py --device cuda --data /tmp/eagle/data -o FILE  # a GPU
"""

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import speculative.train.trainer as trainer  # noqa: E402
from speculative.drafter_format import load_drafter
from speculative.engine.llm_engine import encode_prompt  # noqa: E402
from speculative.train.config import TrainConfig  # noqa: E402
from speculative.train.data import TokenStore, batches, collate, load_data  # noqa: E402
from speculative.train.drafter_init import load_target  # noqa: E402
from speculative.train.trainer import train_step  # noqa: E402
from speculative.train.ttt import loss_rows  # noqa: E402
from workers.device import pick_device, pick_dtype  # noqa: E402
from workers.models.loader import resolve_model


def gsm8k_store(model: str, path: Path) -> TokenStore:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    seqs, prompt_lens = [], []
    with gzip.open(path, "rt") as f:
        for line in list(f)[:2000]:
            row = json.loads(line)
            prompt = encode_prompt(tokenizer, row["question"])
            seqs.append(prompt + tokenizer.encode(row["answer"], add_special_tokens=False))
            prompt_lens.append(len(prompt))
    return TokenStore.from_lists(seqs, prompt_lens)


def every_row(lengths, prompt_lens, T, prompt_weight=0.0):
    """Rows t < T-1 of every sequence, weight 0 where the loss reads nothing: a stand-in for the
    work before rows were selected (the distributions and the loss over the whole padded batch; the
    old code also rolled the distributions by one position, which this leaves out)."""
    rows, row_weight = loss_rows(lengths, prompt_lens, T, prompt_weight)
    B = len(lengths)
    every = (
        torch.arange(B, device=rows.device)[:, None] * T + torch.arange(T - 1, device=rows.device)
    ).flatten()
    weight = torch.zeros(B * T, device=rows.device)
    weight[rows] = row_weight
    return every, weight[every]


def steps_per_second(
    cfg, target, drafter, batch_list, device, dtype
) -> tuple[float, float | None, float]:
    """(steps/s, peak GB on the GPU, the first batch's loss). The optimizer runs at learning rate 0:
    all its work, and every variant sees the same weights."""
    params = [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW(params, lr=0.0)
    draft_to_target = (
        torch.arange(drafter.cfg.draft_vocab_size, device=device) + drafter.d2t
    ).long()

    def step(batch):
        loss, _ = train_step(cfg, target, drafter, draft_to_target, batch, device, dtype)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    first_loss = [step(batch) for batch in batch_list[:2]][0]  # warm-up: kernels for these shapes
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for batch in tqdm(batch_list, desc="steps", leave=False):
        step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak_gb = round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None
    return len(batch_list) / (time.perf_counter() - start), peak_gb, first_loss


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        type=Path,
        default=Path("speculative/train/smollm2_135m.json"),
        help="the TrainConfig whose batches and TTT depth to use",
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="speculative/drafters/smollm2-135m")
    p.add_argument(
        "--data", type=Path, help="distilled parts (or --data-root: GSM8K train with its answers)"
    )
    p.add_argument(
        "--data-root",
        type=Path,
        help="folder with gsm8k/train.jsonl.gz (not shipped: training data)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batch-tokens", type=int, help="default: the config's")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args()
    if not args.data and not args.data_root:
        p.error("give --data or --data-root")
    device = pick_device(args.device)
    dtype = pick_dtype("auto", device)
    cfg = TrainConfig(**json.loads(args.config.read_text()))
    cfg = cfg.model_copy(update={"batch_tokens": args.batch_tokens or cfg.batch_tokens})
    store = (
        load_data(args.data)
        if args.data
        else gsm8k_store(args.model, args.data_root / "gsm8k" / "train.jsonl.gz")
    )
    batch_list = [
        collate(store, b, cfg.max_seq_len)
        for b in batches(store, cfg.batch_tokens, cfg.max_seq_len, seed=0, epoch=0)[: args.steps]
    ]
    target = load_target(args.model, device, dtype)
    # .to(device) only, as the trainer does: a dtype would also cast the embeddings it shares with
    # the target
    drafter = load_drafter(Path(args.drafter), target_embeddings=target.embed_tokens).to(device)
    for n, param in drafter.named_parameters():
        param.requires_grad_(not n.startswith("embed_tokens"))
    results = {}
    for name, rows_fn in {"every row (before)": every_row, "loss rows (now)": loss_rows}.items():
        trainer.loss_rows = rows_fn  # train_step reads it at call time
        rate, peak_gb, loss = steps_per_second(cfg, target, drafter, batch_list, device, dtype)
        results[name] = {
            "steps_per_s": round(rate, 3),
            "tokens_per_s": round(rate * cfg.batch_tokens),
            "peak_gb": peak_gb,
            "first_batch_loss": round(loss, 5),
        }
    trainer.loss_rows = loss_rows
    read = [
        len(loss_rows(lengths, prompt_lens, ids.shape[1])[0]) / ids.numel()
        for ids, lengths, prompt_lens in batch_list
    ]
    rows_share = round(sum(read) / len(read), 3)
    base = results["every row (before)"]["steps_per_s"]
    print(
        f"{'rows':20} {'steps/s':>8} {'vs before':>9} {'peak GB':>8} {'loss, batch 1':>13}   "
        f"({device.type}, {dtype}, "
        f"{cfg.batch_tokens} tokens a batch, vocab {drafter.cfg.draft_vocab_size}, TTT "
        f"{cfg.ttt_steps}, "
        f"the loss reads {rows_share:.0%} of the rows)"
    )
    for name, r in results.items():
        print(
            f"{name:20} {r['steps_per_s']:>8.3f} {r['steps_per_s'] / base:>8.2f}x "
            f"{str(r['peak_gb']):>8} "
            f"{r['first_batch_loss']:>13.5f}"
        )
    if args.output:
        args.output.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "device": device.type,
                    "loss_rows_share": rows_share,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
