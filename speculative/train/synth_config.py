"""Configuration of a synthesized corpus (pydantic, extra fields forbidden): the target writes the
user turns itself, then answers them (speculative/train/synthesize.py)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# what the user turns ask for; each kind has system prompts and seed phrases that steer the target
RequestKind = Literal["writing", "chat", "reasoning", "code", "extraction", "system"]
REQUEST_KINDS: tuple[str, ...] = RequestKind.__args__


class SynthConfig(BaseModel):
    """A corpus of conversations the target writes both sides of, with no dataset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_conversations: int = Field(4096, ge=1)
    kinds: list[RequestKind] = Field(default_factory=lambda: list(REQUEST_KINDS), min_length=1)
    # conversations that go on with a follow-up user turn (written the same way) and its answer
    multi_turn_fraction: float = Field(0.3, ge=0.0, le=1.0)
    max_user_tokens: int = Field(160, ge=4)
    min_user_words: int = Field(3, ge=1)  # shorter user turns are dropped
    # Magpie's sampling of user turns: the whole distribution, so the turns differ
    user_temperature: float = Field(1.0, gt=0.0, le=2.0)
    user_top_p: float = Field(0.99, gt=0.0, le=1.0)
    max_tokens: int = Field(320, ge=1)  # answer tokens per turn
    sampled_fraction: float = Field(0.5, ge=0.0, le=1.0)  # answers sampled; the rest greedy
    temperature: float = Field(0.7, gt=0.0, le=2.0)  # of sampled answers
    max_batch_size: int = Field(256, ge=1, le=1024)
    max_model_len: int = Field(2048, ge=64)
    # JSONL(.gz) benchmark sets: user turns sharing a 13-word run with any of their prompts are
    # dropped (the CLI adds every set shipped in deployments/data/)
    decontaminate_files: list[str] = Field(default_factory=list)
    # user turns whose word 5-gram shingles overlap a kept one's this much (Jaccard) are dropped
    near_duplicate_threshold: float = Field(0.7, gt=0.0, le=1.0)
    time_limit_s: float | None = Field(None, gt=0)  # stop starting rounds after this (resumable)
    seed: int = 0
