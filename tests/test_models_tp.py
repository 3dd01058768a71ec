"""The families through TP=2 on gloo (Ray workers): Qwen2's biased q/k/v projections shard with
their heads (yarn RoPE), Qwen3's per-head q/k norms, Llama 3.1's scaled RoPE and Mistral's layer;
greedy output stays transformers' token for token."""

import pytest
import ray
from conftest import tiny_prompts
from tiny_families import assert_greedy_equal, hf_greedy, write_tiny_family

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.coordinator import CoordinatorActor


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize(
    "family, rope",
    [("qwen2", "yarn"), ("qwen3", "default"), ("llama", "llama3"), ("mistral", "default")],
)
def test_tp2_greedy_matches_transformers(tmp_path, family, rope):
    target = write_tiny_family(tmp_path / family, family, rope)
    prompts = tiny_prompts(3, vocab=96, seed=2, min_len=20, max_len=150)
    cfg = EngineConfig(
        model=str(target),
        drafter="default",  # a random drafter for this target: speculative, still exact
        max_batch_size=4,
        max_model_len=256,
        tp=2,
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
