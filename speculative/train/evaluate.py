"""The exported drafter's acceptance on held-out prompts, measured through our engine: what a
user sees at the end of `eagleserve train-drafter`."""

import logging

from speculative.jsonl import read_rows
from speculative.train.config import TrainConfig
from speculative.train.decontaminate import prompt_texts

MAX_PROMPT_LEN = 768  # longer prompts are left out (some of the sum set's articles)

log = logging.getLogger(__name__)


def exported_acceptance(cfg: TrainConfig) -> dict:
    """Mean acceptance length (1 + accepted drafts per target forward) of the drafter in
    `cfg.output`, greedy and sampled at 0.7, at K = min(ttt_steps, 5), on the first
    `eval_num_prompts` prompts of `eval_prompt_files` (chat template applied)."""
    from speculative.config import EngineConfig, SamplingParams
    from speculative.engine.llm_engine import LLMEngine, encode_chats

    k = min(cfg.ttt_steps, 5)
    max_len = MAX_PROMPT_LEN + cfg.eval_max_tokens
    engine = LLMEngine(
        EngineConfig(
            model=cfg.model,
            drafter=cfg.output,
            num_draft_tokens=k,
            device=cfg.device,
            max_batch_size=min(cfg.eval_num_prompts, 32),
            max_model_len=max_len,
            max_num_batched_tokens=max_len * min(cfg.eval_num_prompts, 32),
        )
    )
    engine.scheduler.tokenizer = None  # acceptance needs no detokenizing
    texts = heldout_prompts(cfg.eval_prompt_files, cfg.eval_num_prompts)
    chats = [[{"role": "user", "content": t}] for t in texts]
    prompts = [p for p in encode_chats(engine.tokenizer, chats) if len(p) <= MAX_PROMPT_LEN]
    result = {"k": k, "num_prompts": len(prompts), "max_tokens": cfg.eval_max_tokens}
    for name, temperature in (("greedy", 0.0), ("sampled_0.7", 0.7)):
        params = SamplingParams(
            temperature=temperature, max_tokens=cfg.eval_max_tokens, seed=0 if temperature else None
        )
        requests = engine.generate(prompts, params)
        steps = sum(r.num_verify_steps for r in requests)
        result[name] = round(sum(r.num_verify_emitted for r in requests) / max(steps, 1), 3)
    print(
        f"acceptance length of {cfg.output} at K={k} on {len(prompts)} held-out prompts: "
        f"{result['greedy']:.2f} greedy, {result['sampled_0.7']:.2f} sampled at 0.7 "
        "(1.00: no draft accepted)",
        flush=True,
    )
    return result


def heldout_prompts(files: list[str], num: int) -> list[str]:
    """The first prompt (first turn) of each row, as many from every file, `num` in all."""
    per_file = [
        [prompt_texts(row)[0] for _, row in read_rows(f) if prompt_texts(row)] for f in files
    ]
    share = -(-num // max(len(files), 1))
    return [t for texts in per_file for t in texts[:share]][:num]
