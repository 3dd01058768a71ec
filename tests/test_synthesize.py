"""A drafter with no dataset: the target writes its training conversations itself (user turns
from its chat template's user-turn prefix), filtered for duplicates and benchmark prompts, then
`eagleserve train-drafter --synthesize N` trains on them, resumably, and the drafter it exports
loads into the engine and keeps greedy output exact."""

import json

import pytest
from tiny_models import tiny_llama

from deployments.cli import main
from deployments.prompt_sets import GSM8K_TEST, benchmark_files
from speculative.config import EngineConfig, SamplingParams
from speculative.engine.llm_engine import LLMEngine, encode_prompt
from speculative.train.corpus import corpus_store
from speculative.train.decontaminate import (
    Decontaminator,
    DuplicateFilter,
    read_benchmark_prompts,
)
from speculative.train.synthesize import read_corpus, user_turn_prefix
from workers.models.loader import load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("smollm2-135m"))


def test_user_turn_prefix_stops_at_the_user_turns_opening(tokenizer):
    first = user_turn_prefix(tokenizer, [])
    assert first.endswith("<|im_start|>user\n") and "<|im_start|>system" in first
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    later = user_turn_prefix(tokenizer, history)
    assert later.endswith("Hello!<|im_end|>\n<|im_start|>user\n")
    assert later.startswith(tokenizer.apply_chat_template(history, tokenize=False))


def test_duplicates_and_near_duplicates_are_dropped():
    kept = DuplicateFilter(threshold=0.7)
    text = "Write a short story about a dragon who learns to bake bread in a small seaside village"
    assert kept.add(text)
    assert not kept.add(text.upper() + "!")  # the same once normalised
    assert not kept.add(text.replace("village", "town"))  # 12 of 14 shingles shared
    assert kept.add("How do I reverse a linked list in Rust without recursion?")


def test_benchmark_prompts_are_caught_inside_longer_text():
    benchmark = read_benchmark_prompts([str(f) for f in benchmark_files()])
    question = read_benchmark_prompts([str(GSM8K_TEST)])[5]
    assert len(benchmark) > 1600  # GSM8K test, the EAGLE sets and the held-out sets
    filter_ = Decontaminator(benchmark)
    assert filter_.is_contaminated(f"Please help me with this. {question} Thanks!")
    assert not filter_.is_contaminated("Write a haiku about the first snow in a quiet town.")


def test_corpus_store_renders_the_template_and_marks_the_prompt(tokenizer):
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
    ]
    store = corpus_store(
        [{"messages": messages}, {"messages": messages[:2], "truncated": True}], tokenizer, 512
    )
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(store.seq(0)) == whole.removesuffix("\n")  # through <|im_end|>
    prompt = tokenizer.decode(store.seq(0)[: store.prompt_lens[0]])
    assert prompt.endswith("Name a colour.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(store.seq(1)).endswith("assistant\nBlue.")  # cut: no end of turn


def test_train_drafter_from_nothing_but_the_model(tmp_path, capsys):
    """One command from a model directory: a first run stopped by its synthesis time limit leaves
    part of the corpus; the rerun continues it (the rows already there kept as they were), trains,
    exports, prints its estimate and the acceptance reached. The drafter then loads into the
    engine, and greedy speculative output equals plain decoding token for token."""
    model = tiny_llama(tmp_path / "target", layers=4)
    config = tmp_path / "train.json"
    config.write_text(
        json.dumps(
            {
                "synthesize": {
                    "max_batch_size": 1,  # a round of 4 conversations at most
                    "max_user_tokens": 12,
                    "max_tokens": 12,
                    "max_model_len": 192,
                    "multi_turn_fraction": 1.0,
                },
                "draft_vocab_size": 256,
                "ttt_steps": 3,
                "lr": 3e-3,
                "warmup_steps": 1,
                "batch_tokens": 1024,
                "eval_num_prompts": 4,
                "eval_max_tokens": 12,
            }
        )
    )
    out = tmp_path / "drafter"
    command = ["train-drafter", "--config", str(config), "--model", str(model), "-o", str(out)]
    command += ["--synthesize", "6", "--max-steps", "3", "--device", "cpu"]
    main(command + ["--synthesize-time-limit", "0.001"])
    corpus = tmp_path / "drafter.data" / "synthetic.jsonl"
    first = read_corpus(corpus)
    assert len(first) == 4 and not out.exists()
    assert "estimate: synthesis of 6 conversations" in capsys.readouterr().out

    main(command)
    rows = read_corpus(corpus)
    assert len(rows) == 6 and rows[:4] == first
    roles = [[m["role"] for m in r["messages"] if m["role"] != "system"] for r in rows]
    assert all(r[:2] == ["user", "assistant"] and r[-1] == "assistant" for r in roles)
    assert ["user", "assistant"] * 2 in roles  # follow-up turns, written by the target too
    printed = capsys.readouterr().out
    assert "estimate: synthesis of 2 conversations" in printed
    assert "acceptance length of" in printed and "held-out prompts" in printed
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["step"] == 3 and summary["acceptance"]["num_prompts"] == 4

    def outputs(drafter):
        engine = LLMEngine(
            EngineConfig(
                model=str(model), drafter=drafter, max_batch_size=4, max_model_len=128, device="cpu"
            )
        )
        prompts = [encode_prompt(engine.tokenizer, f"Say {w}.") for w in ("hi", "yes", "no")]
        done = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
        return [r.output_ids for r in done]

    assert outputs(str(out)) == outputs("none")
