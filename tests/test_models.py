"""The families users bring (Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3) against Hugging Face
transformers on CPU in fp32: RoPE tables as transformers computes them, config reading and
refusals, greedy output token for token, speculative greedy equal to plain, and the sampled
distribution of a new family."""

import json

import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts, write_random_drafter
from tiny_families import assert_greedy_equal, hf_greedy, write_gguf_twin, write_tiny_family

from speculative.config import SamplingParams
from workers.layers.rotary import Rotary, rope_frequencies
from workers.models import MODELS, ModelConfig
from workers.models.config import eos_token_ids
from workers.models.loader import resolve_model

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
CASES = [  # (family, rope type, config overrides)
    ("llama", "default", {}),
    ("llama", "linear", {}),
    ("llama", "dynamic", {}),
    ("llama", "llama3", {}),
    ("llama", "yarn", {}),
    ("mistral", "default", {}),
    ("qwen2", "default", {"tie_word_embeddings": True}),
    ("qwen2", "yarn", {}),
    ("qwen3", "default", {}),
]
# published parameters: Llama 3.1's llama3 rule and Qwen2.5's yarn (their config.json files)
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA31 |= {"original_max_position_embeddings": 8192}
QWEN25_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
HF_ROPES = [
    (128, 500000.0, LLAMA31),
    (128, 1000000.0, QWEN25_YARN),
    (64, 10000.0, QWEN25_YARN | {"beta_fast": 16, "mscale": 2.0, "mscale_all_dim": 1.0}),
    (64, 10000.0, QWEN25_YARN | {"attention_factor": 1.3, "truncate": False}),
    (64, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    (64, 10000.0, {"rope_type": "dynamic", "factor": 4.0}),
    (96, 10000.0, None),
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        (family, rope): write_tiny_family(root / f"{family}-{rope}", family, rope, **overrides)
        for family, rope, overrides in CASES
    }


@pytest.fixture(scope="module")
def prompts():
    # long enough to reach past the scaled ropes' 64 (llama3) and 128 (yarn) original positions
    return tiny_prompts(3, vocab=96, seed=1, min_len=20, max_len=150)


@pytest.mark.parametrize("head_dim, theta, rope", HF_ROPES)
def test_rope_tables_match_transformers(head_dim, theta, rope):
    """inv_freq and the attention factor from transformers' ROPE_INIT_FUNCTIONS, cos and sin from
    its LlamaRotaryEmbedding at positions up to 4096."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters=dict(rope or {"rope_type": "default"}, rope_theta=theta),
    )
    ours = ModelConfig.from_hf(hf_cfg.to_dict())
    inv_freq, factor = rope_frequencies(head_dim, ours.rope_theta, ours.rope_scaling)
    if rope is not None:
        hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
        assert torch.equal(inv_freq, hf_inv_freq) and factor == hf_factor
    positions = torch.tensor([[0, 1, 7, 100, 1000, 4095]])
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions)
    rotary = Rotary(head_dim, 4096, ours.rope_theta, ours.rope_scaling)
    half = head_dim // 2
    torch.testing.assert_close(rotary.cos[positions[0]], hf_cos[0], rtol=0, atol=1e-6)
    sin = rotary.sin[positions[0]]
    torch.testing.assert_close(sin[:, half:], hf_sin[0, :, half:], rtol=0, atol=1e-6)
    torch.testing.assert_close(-sin[:, :half], hf_sin[0, :, :half], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family, rope, overrides", CASES)
def test_greedy_matches_transformers(dirs, prompts, family, rope, overrides):
    engine = tiny_engine(dirs[family, rope], max_model_len=256)
    assert type(engine.executor.target) is MODELS[engine.executor.target_cfg.architecture]
    requests = run_to_completion(engine, prompts, GREEDY)
    for prompt, request in zip(prompts, requests):
        assert_greedy_equal(request.output_ids, *hf_greedy(dirs[family, rope], prompt, 16))


@pytest.mark.parametrize(
    "family, rope", [("llama", "llama3"), ("qwen2", "yarn"), ("qwen3", "default")]
)
def test_speculative_greedy_equals_plain(dirs, prompts, tmp_path, family, rope):
    target = dirs[family, rope]
    drafter = write_random_drafter(tmp_path / "drafter", target)
    plain = run_to_completion(tiny_engine(target, max_model_len=256), prompts, GREEDY)
    drafted = run_to_completion(
        tiny_engine(target, drafter, k=3, max_model_len=256), prompts, GREEDY
    )
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]


def test_rope_parameters_and_rope_scaling_read_alike(dirs):
    """transformers 5 writes rope_parameters (theta inside); older files rope_scaling + rope_theta
    with `type` for `rope_type`."""
    config = json.loads((dirs["llama", "llama3"] / "config.json").read_text())
    new = ModelConfig.from_hf(config)
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
    scaling["type"] = scaling.pop("rope_type")
    old |= {"rope_scaling": scaling, "rope_theta": config["rope_parameters"]["rope_theta"]}
    assert ModelConfig.from_hf(old).rope_scaling == new.rope_scaling
    assert new.rope_scaling["rope_type"] == "llama3" and new.rope_theta == 10000.0


def test_eos_ids_from_config_and_generation_config(tmp_path):
    """Llama 3 Instruct: config.json says 128001 or [128001, 128008, 128009], and
    generation_config.json lists all three."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 128001}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [128001, 128008, 128009]})
    )
    assert eos_token_ids(tmp_path) == {128001, 128008, 128009}


REFUSED = [  # (config changes, words the error must contain)
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ({"vision_config": {"hidden_size": 8}}, "vision_config"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "latent attention"),
    ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": 4,
      "num_experts_per_tok": 2, "swiglu_alpha": 2.0}, "swiglu_alpha"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "num_local_experts"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
]  # fmt: skip


@pytest.mark.parametrize("changes, named", REFUSED)
def test_unsupported_models_refused_by_field(dirs, changes, named):
    config = json.loads((dirs["qwen2", "default"] / "config.json").read_text())
    config.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(config | changes)


def test_mistral_sliding_window_shorter_than_the_context_is_refused(dirs):
    config = json.loads((dirs["mistral", "default"] / "config.json").read_text())
    assert ModelConfig.from_hf(config | {"sliding_window": 256}).max_len(256) == 256
    assert ModelConfig.from_hf(config).max_len(512) == 512  # null: no window
    with pytest.raises(ValueError, match="sliding_window 128 is shorter than the context"):
        ModelConfig.from_hf(config | {"sliding_window": 128}).max_len(256)
    # by default the context is the window's, where it is shorter than the positions
    assert ModelConfig.from_hf(config | {"sliding_window": 128}).max_len(None) == 128
    assert ModelConfig.from_hf(config).max_len(None) == config["max_position_embeddings"]


def test_sampled_distribution_qwen3(tmp_path):
    """The chi-square test of test_lossless on a Qwen3 target (q/k norm, head_dim 24 > 32 / 2)
    with the oracle's drafts accepted often."""
    from test_lossless import SAMPLING, V16, _engine, chi2_pvalue, exact_joint, sample_first_three

    target = write_tiny_family(
        tmp_path / "qwen3-v16",
        "qwen3",
        seed=5,
        std=0.15,
        vocab_size=V16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    dirs = (target, write_random_drafter(tmp_path / "drafter", target, seed=6))
    params = SAMPLING["t0.7-topk5-topp0.9"]
    joint, conditionals = exact_joint(target, params)
    counts = sample_first_three(_engine(dirs, True, 3), params, conditionals)
    p_value = chi2_pvalue(counts, joint)
    print(f"chi-square p-value {p_value:.3g}")
    assert p_value > 1e-3


def test_start_log_says_kv_per_token_and_concurrency(dirs, caplog):
    """Qwen3 tiny: 4 layers x 2 KV heads x head_dim 24 x (k, v) x 4 bytes (fp32) per token."""
    with caplog.at_level("INFO", logger="workers.model_runner"):
        engine = tiny_engine(dirs["qwen3", "default"], max_batch_size=3, max_model_len=200)
    kv = engine.executor.kv
    line = next(r.getMessage() for r in caplog.records if "bytes per token" in r.getMessage())
    assert "weights 0.00 GiB on this rank" in line
    assert f"KV cache {4 * 2 * 24 * 2 * 4} bytes per token" in line
    # by default on CPU the pool holds every slot at full length (1 GiB at most)
    assert "sized by the CPU default of every slot at full length" in line
    tokens = 3 * kv.cache_len
    assert f"{kv.num_blocks} blocks of {kv.block_size} = {tokens} tokens of KV fit" in line
    assert f"maximum concurrency {tokens / 200:.2f} requests at max_model_len 200" in line


@pytest.mark.parametrize("family, rope", [("llama", "llama3"), ("qwen2", "yarn")])
def test_gguf_twin_matches_the_hugging_face_checkpoint(
    dirs, prompts, tmp_path, monkeypatch, family, rope
):
    """A Llama 3.1-style (rope_freqs.weight) and a Qwen2.5-style (biases, yarn metadata) GGUF
    written by the gguf package greedy-decode as transformers does on the Hugging Face twin."""
    monkeypatch.setenv("EAGLESERVE_CACHE", str(tmp_path / "cache"))
    hf_dir = dirs[family, rope]
    path = write_gguf_twin(hf_dir, tmp_path / f"{family}.gguf")
    converted = ModelConfig.from_dir(resolve_model(str(path)))
    assert converted.architecture == ModelConfig.from_dir(hf_dir).architecture
    assert converted.rope_scaling["rope_type"] == {"llama": "freq_factors", "qwen2": "yarn"}[family]
    requests = run_to_completion(tiny_engine(path, max_model_len=256), prompts, GREEDY)
    for prompt, request in zip(prompts, requests):
        assert_greedy_equal(request.output_ids, *hf_greedy(hf_dir, prompt, 16))
