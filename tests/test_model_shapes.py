"""The published configs at their real sizes, built on the meta device (no weights, no memory) at
TP 1, 2, 4 and 8 over PyTorch's fake process group: every shard's shape, and a clear error where
the heads do not divide. Numbers from the models' config.json files on the Hugging Face Hub:
meta-llama/Llama-3.1-8B-Instruct, meta-llama/Llama-3.3-70B-Instruct, Qwen/Qwen2.5-7B-Instruct,
Qwen/Qwen3-8B, and the EAGLE-3 heads yuhuili/EAGLE3-LLaMA3.1-Instruct-8B,
yuhuili/EAGLE3-LLaMA3.3-Instruct-70B and a Qwen3-8B head (AngelSlim/Qwen3-8B_eagle3)."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from speculative.drafter import DrafterConfig, Eagle3Drafter
from workers.models import ModelConfig, model_class

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA3_ROPE,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "eos_token_id": [128001, 128008, 128009],
}
TARGETS = {
    "Llama-3.1-8B-Instruct": LLAMA
    | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
    | {"num_attention_heads": 32},
    "Llama-3.3-70B-Instruct": LLAMA
    | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
    | {"num_attention_heads": 64},
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
    },
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
}
HEAD = {"num_hidden_layers": 1, "draft_vocab_size": 32000, "max_position_embeddings": 2048}
HEADS = {  # the target each head is for -> its config.json
    "Llama-3.1-8B-Instruct": HEAD
    | {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32}
    | {"num_key_value_heads": 8, "vocab_size": 128256},
    "Llama-3.3-70B-Instruct": HEAD
    | {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64}
    | {"num_key_value_heads": 8, "vocab_size": 128256},
    "Qwen3-8B": HEAD
    | {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32}
    | {"num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1e6},
}


def build_on_meta(name: str, tp: int, rank: int):
    """-> (target, drafter or None) as rank `rank` of `tp` builds them, on the meta device."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    try:
        cfg = ModelConfig.from_hf(TARGETS[name])
        with torch.device("meta"):
            target = model_class(cfg)(cfg, dist.group.WORLD, max_positions=16)
            drafter = None
            if name in HEADS:
                drafter_cfg = DrafterConfig.from_hf(HEADS[name])
                drafter = Eagle3Drafter(drafter_cfg, 3, dist.group.WORLD, 16, target.embed_tokens)
        return target, drafter
    finally:
        dist.destroy_process_group()


def expected_layer_shapes(c: dict, tp: int, in_features: int) -> dict[str, tuple]:
    heads, kv, hidden, inter = (
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["hidden_size"],
        c["intermediate_size"],
    )
    D = c.get("head_dim") or hidden // heads
    return {
        "self_attn.qkv_proj.weight": ((heads + 2 * kv) * D // tp, in_features),
        "self_attn.o_proj.weight": (hidden, heads * D // tp),
        "mlp.gate_up_proj.weight": (2 * inter // tp, hidden),
        "mlp.down_proj.weight": (hidden, inter // tp),
    }


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(TARGETS))
def test_published_shapes_shard(name, tp):
    c = TARGETS[name]
    if c["num_attention_heads"] % tp or c["num_key_value_heads"] % tp:
        with pytest.raises(ValueError, match=f"tensor-parallel size {tp} must divide"):
            build_on_meta(name, tp, 0)
        return
    target, drafter = build_on_meta(name, tp, tp - 1)
    params = dict(target.named_parameters())
    per_layer = expected_layer_shapes(c, tp, c["hidden_size"])
    for i in range(c["num_hidden_layers"]):
        for leaf, shape in per_layer.items():
            assert tuple(params[f"layers.{i}.{leaf}"].shape) == shape, (name, tp, i, leaf)
    vocab_shard = (c["vocab_size"] // tp, c["hidden_size"])
    assert tuple(params["embed_tokens.weight"].shape) == vocab_shard
    assert tuple(params["lm_head.weight"].shape) == vocab_shard
    if c["model_type"] == "qwen2":
        assert tuple(params["layers.0.self_attn.qkv_proj.bias"].shape) == (4608 // tp,)
    if c["model_type"] == "qwen3":
        assert tuple(params["layers.0.self_attn.q_norm.weight"].shape) == (128,)
    if drafter is not None:
        h = HEADS[name]
        head = dict(drafter.named_parameters())
        for leaf, shape in expected_layer_shapes(h, tp, 2 * h["hidden_size"]).items():
            assert tuple(head[f"midlayer.{leaf}"].shape) == shape, (name, tp, leaf)
        assert tuple(head["fc.weight"].shape) == (h["hidden_size"], 3 * c["hidden_size"])
        assert tuple(head["lm_head.weight"].shape) == (32000 // tp, h["hidden_size"])
