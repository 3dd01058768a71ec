"""Tiny random-weight checkpoints of every supported family, built and saved by transformers
itself (its config class, its model, save_pretrained), with weights wide enough that greedy
choices are not near-ties (the rule of conftest.write_tiny_llama)."""

import json
from pathlib import Path

import torch

FAMILIES = {  # family -> (transformers config class, extra config fields)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 24, "use_sliding_window": False}),
    # mixtures of experts: experts of several widths, some dense layers, a shared expert
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
        | {"shared_expert_intermediate_size": 96, "mlp_only_layers": [1]},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 24, "head_dim": 24}
        | {"norm_topk_prob": True, "decoder_sparse_step": 2},
    ),
    # sinks, biases, a window short enough for the prompts to slide past it, YaRN as published
    "gpt_oss": (
        "GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}
        | {"head_dim": 16, "sliding_window": 8, "swiglu_limit": 1.5}
        | {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            }
        },
    ),  # fmt: skip
}
ROPES = {  # rope_type -> rope_scaling, as the published configs write it
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    # Llama 3.1's parameters, scaled to a 64-position original context
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    # Qwen2.5's long-context setting, scaled likewise
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def tiny_config(family: str, rope: str = "default", **overrides) -> dict:
    config = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "rope_scaling": dict(ROPES[rope]) if ROPES[rope] else None,  # transformers fills it in
    }
    return config | FAMILIES[family][1] | overrides


def init_wide_(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    H = model.config.hidden_size
    proj = std * 8 / H**0.5
    for name, p in sorted(model.named_parameters()):
        if name.endswith("embed_tokens.weight"):
            scale, base = 1.0, 0.0
        elif "norm" in name:
            scale, base = 0.1, 1.0
        elif name.endswith("lm_head.weight"):
            scale, base = 3.0 / H**0.5, 0.0
        else:  # projections and their biases
            scale, base = proj, 0.0
        p.data = base + torch.randn(p.shape, generator=g) * scale


def write_tiny_family(
    path: Path, family: str, rope: str = "default", seed: int = 0, std: float = 0.2, **overrides
) -> Path:
    """A random checkpoint of `family` in the Hugging Face layout, written by transformers."""
    import transformers

    config_class = getattr(transformers, FAMILIES[family][0])
    config = config_class(**tiny_config(family, rope, **overrides))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_wide_(model, seed, std)
    if config.tie_word_embeddings:
        model.tie_weights()
    path = Path(path)
    model.save_pretrained(str(path))
    return path


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], list]:
    """transformers' own greedy continuation, recomputing the whole sequence each token (its
    rope as it computes it for the sequence so far) -> (ids, top-two logits at each step)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, tops = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            tops.append(logits.topk(2))
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], tops


def assert_greedy_equal(ours: list[int], reference: list[int], tops, tol: float = 1e-4) -> None:
    """Token for token, or the first difference is a near-tie of the reference's top two."""
    if ours == reference:
        return
    n = next(i for i, (a, b) in enumerate(zip(ours, reference)) if a != b)
    top = tops[n]
    gap = (top.values[0] - top.values[1]).item()
    assert gap < tol and ours[n] in top.indices.tolist(), (
        f"outputs differ at new token {n}: ours {ours[n : n + 3]}, reference "
        f"{reference[n : n + 3]}; top-two logits differ by {gap:.2e} (not a near-tie)"
    )


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _head_state(target_dir: Path, draft_vocab: int, seed: int) -> tuple[dict, dict]:
    """(target config, random EAGLE-3 tensors in the flat names) for a target directory, with a
    draft vocabulary of the target's odd ids (d2t not zero), weights wide as
    write_random_drafter's."""
    from speculative.drafter_format import drafter_config_for, random_drafter_state
    from workers.models import ModelConfig

    target = read_config(target_dir)
    cfg = drafter_config_for(ModelConfig.from_hf(target), draft_vocab)
    state = random_drafter_state(cfg, seed=seed)
    wide = {n: t * 10 for n, t in state.items() if n.endswith("_proj.weight") or n[:2] in "fclm"}
    state |= wide
    state["d2t"] = torch.arange(draft_vocab) + 1  # draft id i -> target id 2i + 1
    state["t2d"] = torch.arange(target["vocab_size"]) % 2 == 1
    return target, state


def write_flat_head(path: Path, target_dir: Path, seed: int = 1) -> Path:
    """Laid out as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: LlamaForCausalLMEagle3, no rope_theta
    (10000) and max_position_embeddings 2048 (here 32) whatever the target's, midlayer.* names,
    no embed_tokens."""
    from safetensors.torch import save_file

    target, state = _head_state(target_dir, 48, seed)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "num_hidden_layers": 1,
        "max_position_embeddings": 32,
        "rms_norm_eps": 1e-5,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": 48,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    if target.get("head_dim"):  # Qwen3's heads (128 wide, not hidden / heads) write it
        config["head_dim"] = target["head_dim"]
    Path(path).mkdir(parents=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(Path(path) / "model.safetensors"))
    return Path(path)


def write_speculators_head(
    path: Path, target_dir: Path, layer_type: str = "llama", norm_before_residual: bool = True
) -> Path:
    """Laid out as vLLM speculators' Eagle3Speculator heads (RedHatAI/*speculator.eagle3): the
    layer's config nested in transformer_layer_config (Llama's, or speculators' Qwen3 layer with
    an explicit head_dim), EAGLE-3 fields on top, tensors named layers.0.*."""
    from safetensors.torch import save_file

    target, state = _head_state(target_dir, 48, seed=2)
    state = {n.replace("midlayer.", "layers.0."): t for n, t in state.items()}
    layer = {
        "architectures": ["LlamaForCausalLM" if layer_type == "llama" else "Qwen3ForCausalLM"],
        "model_type": layer_type,
        "attention_bias": False,
        "hidden_act": "silu",
        "mlp_bias": False,
        "num_hidden_layers": 1,
        "max_position_embeddings": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": target.get("rope_parameters", {}).get("rope_theta", 10000.0),
    }
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        layer[key] = target[key]
    layer |= {"head_dim": target.get("head_dim"), "vocab_size": target["vocab_size"]}
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "verifier": {"architectures": target["architectures"], "name_or_path": "tiny"},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": 48,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
        "torch_dtype": "float32",
    }
    Path(path).mkdir(parents=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(Path(path) / "model.safetensors"))
    return Path(path)


GGUF_TOP = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(name: str) -> str:
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{GGUF_LAYER['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{GGUF_TOP[parts[0]]}.{parts[-1]}"


def llama3_rope_freqs(rope: dict, D: int):
    """Llama 3 scaling as llama.cpp's LlamaModel.generate_extra_tensors writes it: a divisor per
    base frequency."""
    import math

    import numpy as np

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, D, 2) / D):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def write_gguf_twin(hf_dir: Path, path: Path) -> Path:
    """The Hugging Face checkpoint as llama.cpp's convert_hf_to_gguf.py writes it, with the gguf
    package: Llama's q/k rows interleaved for its rope and Llama 3 scaling as rope_freqs.weight
    (per-frequency divisors); Qwen2's q/k as they are, with biases, and yarn as metadata."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = read_config(hf_dir)
    arch = cfg["model_type"]
    heads, kv, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    D = cfg.get("head_dim") or H // heads
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "embedding_length": H,
        "feed_forward_length": cfg["intermediate_size"],
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
    }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        w.add_uint32(
            f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"]
        )
    tensors = {}
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(rope, D)
    for name, t in load_file(str(Path(hf_dir) / "model.safetensors")).items():
        gguf_name = _gguf_name(name)
        a = t.float().numpy()
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            n = heads if "attn_q" in gguf_name else kv  # llama.cpp's permute
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        tensors[gguf_name] = np.ascontiguousarray(a)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
