"""A synthesized corpus as training data: the engine that writes it, the JSONL rows turned into
token sequences (the data directory's parts), and a time estimate from a measured probe."""

import logging
import time

from speculative.train.config import TrainConfig
from speculative.train.data import TokenStore, data_parts, save_parts
from speculative.train.synth_config import SynthConfig

log = logging.getLogger(__name__)

CORPUS_FILE = "synthetic.jsonl"


def synthesis_engine(model: str, device: str, cfg: SynthConfig):
    """Our engine for the target alone, every slot at full length (the pool sized, not
    profiled: a few-minute job should not spend its start on profiling)."""
    from speculative.config import EngineConfig
    from speculative.engine.llm_engine import LLMEngine
    from workers.device import pick_device, pick_dtype
    from workers.kv_sizing import full_length_gb
    from workers.models import ModelConfig
    from workers.models.loader import resolve_model

    dtype = pick_dtype("auto", pick_device(device))
    target_cfg = ModelConfig.from_dir(resolve_model(model))
    return LLMEngine(
        EngineConfig(
            model=model,
            drafter="none",
            device=device,
            max_batch_size=cfg.max_batch_size,
            max_model_len=cfg.max_model_len,
            # the runner pads a prefill batch to its longest prompt: budget for the padded size
            max_num_batched_tokens=max(cfg.max_model_len, cfg.max_batch_size * 512),
            kv_cache_memory_gb=full_length_gb(
                target_cfg, cfg.max_batch_size, cfg.max_model_len, dtype
            ),
        )
    )


def corpus_store(rows: list[dict], tokenizer, max_seq_len: int) -> TokenStore:
    """One sequence per conversation: the chat template over every turn but the last answer, that
    answer's tokens, and the end-of-turn token unless it was cut by max_tokens. The prompt is what
    comes before the first answer; later user turns were written by the target, so they are
    trained on like its answers."""
    from speculative.engine.llm_engine import encode_chats

    seqs, prompt_lens = [], []
    for row in rows:
        messages = row["messages"]
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        head, prompt = encode_chats(tokenizer, [messages[:-1], messages[:first]])
        answer = tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
        end = [] if row.get("truncated") else [tokenizer.eos_token_id]
        seq = (head + answer + end)[:max_seq_len]
        # a template that renders earlier turns differently later: only the last prompt is known
        is_prefix = head[: len(prompt)] == prompt
        seqs.append(seq)
        prompt_lens.append(min(len(prompt) if is_prefix else len(head), len(seq)))
    return TokenStore.from_lists(seqs, prompt_lens)


def synthesize_data(cfg: TrainConfig, estimate: bool = True) -> dict:
    """Grows the data directory's corpus towards `synthesize.num_conversations`; once it is
    complete, writes it as the data directory's parts (training reads those)."""
    from speculative.train.synthesize import Synthesizer, read_corpus

    synth = cfg.synthesize
    path = cfg.data_dir / CORPUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    num_done = len(read_corpus(path))
    if num_done >= synth.num_conversations:  # no engine to start
        summary = {"num_conversations": num_done, "is_complete": True}
    else:
        engine = synthesis_engine(cfg.model, cfg.device, synth)
        if estimate:
            print_estimate(engine, cfg, num_done)
        summary = Synthesizer(engine, synth).run(path)
        del engine
    if summary["is_complete"] and not data_parts(cfg.data_dir):
        from workers.models.loader import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(cfg.model))
        store = corpus_store(read_corpus(path), tokenizer, cfg.max_seq_len)
        save_parts(cfg.data_dir, store)
        summary["num_tokens"] = int(store.lengths.sum())
    log.info("synthesis: %s", summary)
    return summary


def print_estimate(engine, cfg: TrainConfig, num_done: int) -> None:
    """Times one wave of the engine (every slot, a prefill then decoding) and prints what the
    synthesis and the training should take at that rate: rough, the progress bars refine it."""
    from speculative.config import SamplingParams

    synth = cfg.synthesize
    probe_len, probe_tokens = min(128, synth.max_model_len // 2), 16
    num = synth.max_batch_size
    # distinct prompts each time: cached blocks would make the second prefill free
    prompts = [[(7 * i + j) % 1000 + 100 for j in range(probe_len)] for i in range(2 * num)]
    start = time.perf_counter()
    engine.generate(prompts[:num], SamplingParams(max_tokens=1, ignore_eos=True))
    prefill_s = max(time.perf_counter() - start, 1e-6)
    start = time.perf_counter()
    engine.generate(prompts[num:], SamplingParams(max_tokens=probe_tokens, ignore_eos=True))
    decode_s = max(time.perf_counter() - start - prefill_s, 1e-6)
    decode_rate = num * probe_tokens / decode_s  # tokens/s with every slot busy
    prefill_rate = num * probe_len / prefill_s
    # a conversation: a user turn and an answer, a fraction of them twice (about half of the
    # token limits is what turns take)
    turns = (synth.num_conversations - num_done) * (1 + synth.multi_turn_fraction)
    synth_s = turns * 0.5 * (synth.max_user_tokens + synth.max_tokens) / decode_rate
    # a step: the frozen target's forward over batch_tokens, and the drafter's TTT steps
    train_s = cfg.max_steps * 2 * cfg.batch_tokens / prefill_rate
    print(
        f"estimate: synthesis of {synth.num_conversations - num_done} conversations ~"
        f"{_minutes(synth_s)} (decoding at {decode_rate:.0f} tokens/s), training of "
        f"{cfg.max_steps} steps ~{_minutes(train_s)}"
        + (f" (bounded by --time-limit {cfg.time_limit_s:.0f} s)" if cfg.time_limit_s else ""),
        flush=True,
    )


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"
