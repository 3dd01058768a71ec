"""`eagleserve train-drafter` on tiny targets of the new families (Qwen2 with q/k/v biases, Qwen3
with q/k head norms and head_dim 24 != hidden / heads): self-distillation through the engine,
training, export in the flat format, and the exported head loaded by the engine (speculative greedy
equal to plain greedy)."""

import shutil

import pytest
from test_train import QUESTIONS, questions_file
from tiny_families import write_tiny_family

from speculative.config import EngineConfig, SamplingParams
from speculative.drafter_format import read_drafter_config
from speculative.engine.llm_engine import LLMEngine, encode_prompt
from speculative.train.config import DistillConfig, TrainConfig
from speculative.train.pipeline import train_drafter
from workers.models.loader import load_tokenizer, resolve_model


def family_target(path, family: str):
    """A tiny `family` checkpoint with SmolLM2's vocabulary, tokenizer and chat template."""
    write_tiny_family(path, family, vocab_size=49152, hidden_size=64, num_hidden_layers=4)
    for f in resolve_model("smollm2-135m").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def greedy(model, drafter, prompts):
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            drafter=str(drafter),
            num_draft_tokens=3,
            max_batch_size=4,
            max_model_len=256,
            device="cpu",
            dtype="float32",
        )
    )
    requests = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_train_drafter_for_family(tmp_path, family):
    model = family_target(tmp_path / "target", family)
    cfg = TrainConfig(
        model=str(model),
        output=str(tmp_path / "drafter"),
        data=str(tmp_path / "data"),
        distill=DistillConfig(
            prompt_files=[str(questions_file(tmp_path))],
            max_tokens=24,
            sampled_fraction=0.0,
            max_batch_size=8,
            max_prompt_len=128,
        ),
        draft_vocab_size=256,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=2,
        max_steps=6,
        batch_tokens=2048,
        checkpoint_every=6,
        device="cpu",
    )
    summary = train_drafter(cfg)
    assert summary["step"] == 6 and summary["is_complete"]
    head = read_drafter_config(tmp_path / "drafter")
    assert head.head_dim == (24 if family == "qwen3" else 16) and head.draft_vocab_size == 256
    prompts = [encode_prompt(load_tokenizer(model), q) for q in QUESTIONS[:3]]
    assert greedy(model, tmp_path / "drafter", prompts) == greedy(model, "none", prompts)
