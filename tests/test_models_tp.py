"""The families through TP=2 on gloo (Ray workers): Qwen2's biased q/k/v projections shard with
their heads (yarn RoPE), Qwen3's per-head q/k norms, Llama 3.1's scaled RoPE and Mistral's layer;
greedy output stays transformers' token for token. An FP8 checkpoint's weights and scales shard
too, decoding as TP=1 does. Mixtures of experts at TP 2 and 3: every expert split along its
intermediate dimension (Qwen2-MoE's shared expert too), the router whole on every rank."""

import pytest
import ray
from conftest import tiny_prompts
from tiny_families import assert_greedy_equal, hf_greedy, write_tiny_family

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.coordinator import CoordinatorActor


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


# TP 3 needs heads, KV heads and expert widths that 3 divides
TP3_SHAPE = {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}
TP3_SHAPE |= {"intermediate_size": 96, "moe_intermediate_size": 48}


@pytest.mark.parametrize(
    "family, rope, tp",
    [("qwen2", "yarn", 2), ("qwen3", "default", 2), ("llama", "llama3", 2),
     ("mistral", "default", 2), ("qwen2_moe", "default", 2), ("qwen3_moe", "default", 3),
     ("gpt_oss", "default", 2)],
)  # fmt: skip
def test_tp_greedy_matches_transformers(tmp_path, family, rope, tp):
    shape = TP3_SHAPE if tp == 3 else {}
    target = write_tiny_family(tmp_path / family, family, rope, **shape)
    prompts = tiny_prompts(3, vocab=96, seed=2, min_len=20, max_len=150)
    cfg = EngineConfig(
        model=str(target),
        drafter="default",  # a random drafter for this target: speculative, still exact
        max_batch_size=4,
        max_model_len=256,
        tp=tp,
        device="cpu",
        dtype="float32",
    )
    coordinator = CoordinatorActor.remote(cfg)
    try:
        results = ray.get(
            coordinator.generate.remote(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        )
    finally:
        ray.get(coordinator.shutdown.remote())
        ray.kill(coordinator)
    for prompt, result in zip(prompts, results):
        assert_greedy_equal(result["token_ids"], *hf_greedy(target, prompt, 16))


def test_tp2_fp8_checkpoint_decodes_as_tp1(tmp_path):
    """An FP8 checkpoint (compressed-tensors, per-channel scales) over TP=2: weights and scales
    shard with their rows (q/k/v, gate/up), row-parallel layers keep every scale; the greedy
    tokens are TP=1's (each rank quantizes its own slice of the row-parallel activations, as
    vLLM's do: tokens, not bits, are compared, on weights narrow enough (std 0.05) that FP8's
    rounding moves the logits by about 1%)."""
    from conftest import run_to_completion, tiny_engine
    from tiny_fp8 import write_fp8

    target = write_fp8(
        write_tiny_family(tmp_path / "llama", "llama", std=0.05), tmp_path / "fp8", "ct-channel"
    )
    prompts = tiny_prompts(3, vocab=96, seed=2, min_len=20, max_len=150)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = run_to_completion(tiny_engine(target), prompts, params)
    cfg = EngineConfig(model=str(target), drafter="none", max_batch_size=4, max_model_len=256,
                       tp=2, device="cpu", dtype="float32")  # fmt: skip
    coordinator = CoordinatorActor.remote(cfg)
    try:
        results = ray.get(coordinator.generate.remote(prompts, params))
    finally:
        ray.get(coordinator.shutdown.remote())
        ray.kill(coordinator)
    assert [r["token_ids"] for r in results] == [r.output_ids for r in reference]
