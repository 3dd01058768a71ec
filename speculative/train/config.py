"""Drafter training configuration (pydantic, extra fields forbidden), saved beside the output."""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculative.train.synth_config import SynthConfig


class DistillConfig(BaseModel):
    """Self-distillation: the target regenerates responses to training prompts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # JSONL(.gz) rows with "prompt" or "question"
    prompt_files: list[str] = Field(default_factory=list)
    num_prompts: int = Field(8192, ge=1)  # over all passes
    # passes over the prompt order; every response after the first pass is sampled (at
    # `temperature`): more data from the same prompts, where a greedy pass would repeat the first
    num_passes: int = Field(1, ge=1)
    max_prompt_len: int = Field(1024, ge=8)  # longer prompts are skipped
    max_tokens: int = Field(320, ge=1)  # response tokens per prompt
    sampled_fraction: float = Field(0.5, ge=0.0, le=1.0)  # the rest is greedy
    temperature: float = Field(0.7, gt=0.0, le=2.0)
    max_batch_size: int = Field(256, ge=1, le=1024)
    # engines in processes of their own sharing the device, to fill the GPU's idle time while each
    # one's host works (distill.self_distill_in_processes)
    num_workers: int = Field(1, ge=1, le=16)
    time_limit_s: float | None = Field(None, gt=0)  # stop admitting prompts after this
    # prompts of at least this many characters go first (0: none do): long inputs are rare in the
    # training prompts, and the drafter copies poorly from them
    # (BENCHMARKS.md, "where the drafts miss")
    long_prompts_first_chars: int = Field(0, ge=0)
    # keep the prompts left when the time limit stops admission, as sequences without a response
    # (they only teach anything with TrainConfig.prompt_loss_weight > 0)
    keep_undistilled_prompts: bool = False
    # prompts at the start of the order that the data directory's parts do not hold and no run
    # should distil: those an earlier dataset covered (a lost one, to continue its order)
    skip_prompts: int = Field(0, ge=0)
    seed: int = 0

    @model_validator(mode="after")
    def _one_pass_to_keep_prompts(self):
        if self.keep_undistilled_prompts and self.num_passes > 1:
            raise ValueError(
                "keep_undistilled_prompts would keep each prompt once per pass: use num_passes 1"
            )
        return self


class Corpus(BaseModel):
    """A data directory (part-*.safetensors, as distillation or synthesis writes them) and the
    sequences an epoch draws from it, relative to its size (speculative/train/mix.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str
    weight: float = Field(1.0, gt=0.0, le=100.0)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "smollm2-135m"
    output: str  # exported drafter directory
    data: str | None = None  # directory of self-distilled parts; default: OUTPUT.data
    # train on these corpora together instead of `data` alone (which is then only distillation's
    # or synthesis's output)
    corpora: list[Corpus] = Field(default_factory=list)
    checkpoint: str | None = None  # periodic checkpoints; default: OUTPUT.ckpt
    # train further from this drafter instead of a fresh one: its weights, and its head rows for the
    # tokens that the new draft vocabulary (picked from the data) also holds
    init_from: str | None = None
    distill: DistillConfig = DistillConfig()
    # the data written by the target itself, user turns too (no prompt files): see SynthConfig
    synthesize: SynthConfig | None = None
    # prompts (JSONL(.gz), as distill's) of the acceptance printed after training; none: no check
    eval_prompt_files: list[str] = Field(default_factory=list)
    eval_num_prompts: int = Field(32, ge=1)
    eval_max_tokens: int = Field(128, ge=1)
    draft_vocab_size: int = Field(4096, ge=2)
    ttt_steps: int = Field(5, ge=1, le=16)  # unrolled draft steps (K at inference <= this)
    step_decay: float = Field(0.8, gt=0.0, le=1.0)  # loss weight of step j is decay**j
    # loss weight of prompt positions (responses: 1)
    prompt_loss_weight: float = Field(0.0, ge=0.0, le=1.0)
    lr: float = Field(6e-4, gt=0.0)
    min_lr_ratio: float = Field(0.05, ge=0.0, le=1.0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(0.5, gt=0.0)
    max_steps: int = Field(2000, ge=1)
    # passes over the data: the steps they take, at most max_steps (None: max_steps decides)
    num_epochs: float | None = Field(None, gt=0)
    batch_tokens: int = Field(32768, ge=16)  # padded tokens per batch
    # longer sequences are cut (4096: the trainer's rotary tables)
    max_seq_len: int = Field(1536, ge=8, le=4096)
    checkpoint_every: int = Field(200, ge=1)
    time_limit_s: float | None = Field(None, gt=0)  # checkpoint and stop after this (resume later)
    max_steps_this_run: int | None = Field(None, ge=1)  # a slice: checkpoint and stop after these
    # a directory the run continues from when the checkpoint directory has none, and writes its
    # checkpoint to at the end, in files under export_shard_mb (default 15): what travels between
    # slices on machines whose returned files are capped (speculative/train/handover.py)
    handover: str | None = None
    handover_dtype: Literal["float32", "bfloat16"] = "float32"
    handover_optimizer: bool = True  # AdamW's moments too (twice the weights' float32 bytes)
    fit_steps_to_time: bool = False  # shrink max_steps so the LR schedule ends in time
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # of the frozen target and autocast
    # int8: 2-D weights as int8 with a scale per row (drafter_int8.quantize_int8), to fit a size cap
    export_dtype: Literal["float32", "bfloat16", "int8"] = "bfloat16"
    # split the exported weights into files of at most this
    export_shard_mb: float | None = Field(None, gt=0)
    seed: int = 0

    @property
    def data_dir(self) -> Path:
        return Path(self.data) if self.data else _beside(self.output, ".data")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint) if self.checkpoint else _beside(self.output, ".ckpt")


def _beside(path: str, suffix: str) -> Path:
    path = Path(path)  # a trailing slash is dropped: drafters/mine/ -> drafters/mine.data
    return path.with_name(path.name + suffix)
