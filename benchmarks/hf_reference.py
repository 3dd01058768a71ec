"""The outside reference: Hugging Face transformers `generate` (plain and prompt lookup) on the
same GSM8K prompts with the chat template. Prints a table, writes JSON."""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from deployments.bench import load_prompts
from speculative.engine.llm_engine import encode_prompt
from workers.models.loader import load_tokenizer, resolve_model


def run(model, tokenizer, prompts, batch: int, new_tokens: int, lookup: bool) -> dict:
    tokens, start = 0, time.perf_counter()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            **extra,
        )
        for row in out[:, width:]:
            generated = row.tolist()
            tokens += next(
                (j for j, t in enumerate(generated) if t == tokenizer.eos_token_id), len(generated)
            )
    wall = time.perf_counter() - start
    return {
        "batch": batch,
        "prompt_lookup": lookup,
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default=None)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("-o", "--output", default="benchmarks/hf_reference.json")
    args = p.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    prompts = [encode_prompt(tokenizer, q) for q in load_prompts(args.dataset, 8)]
    run(model, tokenizer, prompts[:1], 1, 8, False)  # warm-up
    runs = [
        run(model, tokenizer, prompts[:2], 1, args.output_len, False),
        run(model, tokenizer, prompts[:2], 1, args.output_len, True),
        run(model, tokenizer, prompts[:8], 8, args.output_len, False),
    ]
    print(f"{'HF generate':24} {'batch':>5} {'tok/s':>8}")
    for r in runs:
        print(
            f"{'prompt lookup' if r['prompt_lookup'] else 'plain':24} {r['batch']:>5} "
            f"{r['output_tokens_per_s']:>8.1f}"
        )
    with open(args.output, "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
