"""Start-up and steps in the dtypes a GPU runs, on CPU: the peak-step profile that sizes the pool
by gpu_memory_utilization (every sampling feature on) and steps with every feature, in float32
and bfloat16, with FP8 weights and without, built as the engine builds its runner and as the
GPU benchmarks build theirs (random weights drawn under the run's default dtype). On the H100
the benchmarks' bfloat16 runner died in that profile: a logit_bias row in the default dtype
added to float32 logits."""

import math

import pytest
import torch
from conftest import run_to_completion

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.llm_engine import LLMEngine
from workers import memory_profile
from workers.model_runner import ModelRunner

CASES = [(d, q) for d in ("float32", "bfloat16") for q in (None, "fp8")]
BIASED = 7  # a token every row of the biased request takes


def every_feature(n: int) -> list[SamplingParams]:
    features = [
        dict(logit_bias={BIASED: 100.0}),
        dict(temperature=0.8, top_p=0.9, top_k=8, min_p=0.05, seed=3, logprobs=2),
        dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, min_tokens=4),
        dict(prompt_logprobs=1, logprobs=0),
    ]
    return [SamplingParams(max_tokens=6, **features[i % len(features)]) for i in range(n)]


def check_steps(engine: LLMEngine) -> None:
    prompts = [[1 + (i * 5 + j) % 40 for j in range(9 + i)] for i in range(4)]
    logprobs = {1: [], 3: []}

    def collect(i, output):
        if i in logprobs:
            logprobs[i] += [chosen for chosen, _ in output.logprobs]

    requests = run_to_completion(engine, prompts, every_feature(4), on_output=collect)
    assert [len(r.output_ids) for r in requests] == [6] * 4
    assert requests[0].output_ids == [BIASED] * 6
    for chosen in logprobs.values():
        assert len(chosen) == 6 and all(math.isfinite(lp) and lp <= 0 for lp in chosen)
    scored = [e for e in requests[3].prompt_logprobs if e is not None]
    assert len(scored) == len(prompts[3]) - 1


def config(tiny_dir, tiny_drafter_dir, dtype, quantization) -> EngineConfig:
    return EngineConfig(model=str(tiny_dir), drafter=str(tiny_drafter_dir), num_draft_tokens=3,
                        dtype=dtype, quantization=quantization, device="cpu", max_batch_size=4,
                        max_model_len=96, max_num_batched_tokens=64)  # fmt: skip


@pytest.mark.parametrize("dtype, quantization", CASES)
def test_engine_runner(tiny_dir, tiny_drafter_dir, dtype, quantization):
    cfg = config(tiny_dir, tiny_drafter_dir, dtype, quantization)
    memory_profile.run_peak_steps(profiled := ModelRunner(cfg), profiled.kv.cache_len)
    assert profiled.state.bias_values is not None and profiled.state.grammar_mask is not None
    engine = LLMEngine(cfg)
    assert engine.executor.dtype == getattr(torch, dtype)
    check_steps(engine)


@pytest.mark.parametrize("dtype, quantization", CASES)
def test_benchmark_runner(tiny_dir, tiny_drafter_dir, dtype, quantization):
    """benchmarks/runner_bench.build_runner: the runner built, and on a GPU profiled (inside
    ModelRunner, when gpu_memory_utilization sizes the pool), under torch's default dtype set to
    the run's; the steps here too."""
    from benchmarks import runner_bench

    cfg = config(tiny_dir, tiny_drafter_dir, dtype, quantization)
    with runner_bench.default_dtype(getattr(torch, dtype)):
        runner = runner_bench.build_runner(cfg, graphs=False)
        memory_profile.run_peak_steps(runner, runner.kv.cache_len)
        check_steps(LLMEngine(cfg, executor=runner_bench.build_runner(cfg, graphs=False)))
