"""How long self-distillation spends encoding its prompts (chat template + tokenizer), one prompt at
a time against a batch at a time (`encode_chats`, what `data.distill_order` uses), on the committed
config's prompt files; checks that both give the same ids for every prompt (the order, and so
DISTILL_SKIP, depends on them). Also the time to the first prompt of a job that skips the first
`--skip` (it encodes them all to rebuild the order). Prints a table, writes JSON."""

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from speculative.engine.llm_engine import encode_chats, encode_prompt  # noqa: E402
from speculative.train.config import TrainConfig  # noqa: E402
from speculative.train.data import distill_order, prompt_order, read_prompts  # noqa: E402
from workers.models.loader import load_tokenizer, resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=ROOT / "speculative/train/smollm2_135m.json")
    ap.add_argument(
        "--data-root",
        type=Path,
        required=True,
        help="where the config's .device/data/ prompt files are (training data, not shipped)",
    )
    ap.add_argument("--skip", type=int, default=70763)
    ap.add_argument(
        "-o", "--output", type=Path, default=ROOT / "benchmarks" / "prompt_encoding.json"
    )
    args = ap.parse_args()
    fields = json.loads(args.config.read_text())
    fields["distill"]["prompt_files"] = [
        str(args.data_root / Path(f).relative_to(".device/data"))
        for f in fields["distill"]["prompt_files"]
    ]
    cfg = TrainConfig.model_validate(fields)
    tokenizer = load_tokenizer(
        resolve_model(cfg.model if Path(cfg.model).exists() else "smollm2-135m")
    )
    texts = prompt_order(read_prompts(cfg.distill.prompt_files), cfg.distill)
    chunk = 4 * cfg.distill.max_batch_size

    start = time.perf_counter()
    one = [encode_prompt(tokenizer, t) for t in tqdm(texts, desc="one at a time")]
    one_s = time.perf_counter() - start
    start = time.perf_counter()
    batched = [
        ids
        for i in tqdm(range(0, len(texts), chunk), desc=f"{chunk} at a time")
        for ids in encode_chats(
            tokenizer, [[{"role": "user", "content": t}] for t in texts[i : i + chunk]]
        )
    ]
    batched_s = time.perf_counter() - start
    differ = sum(a != b for a, b in zip(one, batched))
    start = time.perf_counter()
    _, order = distill_order(cfg.distill, tokenizer, skip=args.skip)
    next(order)
    first_s = time.perf_counter() - start
    kept = sum(len(ids) <= cfg.distill.max_prompt_len for ids in one)
    result = {
        "num_prompts": len(texts),
        "kept_under_max_prompt_len": kept,
        "left_after_skip": kept - args.skip,
        "skip": args.skip,
        "chunk": chunk,
        "one_at_a_time_s": one_s,
        "batched_s": batched_s,
        "speedup": one_s / batched_s,
        "prompts_encoded_differently": differ,
        "first_prompt_after_skip_s": first_s,
    }
    print(
        f"{'prompts':>8} {'one at a time':>14} {'batched':>8} {'speed-up':>8} {'differ':>6} "
        f"{'first after skip':>16}"
    )
    print(
        f"{len(texts):>8} {one_s:>13.1f}s {batched_s:>7.1f}s {one_s / batched_s:>7.2f}x "
        f"{differ:>6} {first_s:>15.1f}s"
    )
    args.output.write_text(json.dumps(result, indent=1))
    print(f"results: {args.output}")
    if differ:
        raise SystemExit(f"error: {differ} prompts encode differently in a batch")


if __name__ == "__main__":
    main()
