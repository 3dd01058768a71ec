"""Tiny random Llama directories for the Ray and Serve tests (imported, not fixtures)."""

import json
import shutil

import torch
from safetensors.torch import save_file

from workers.layers.kv_cache import KVCache, KVShape
from workers.models.loader import resolve_model


def tiny_llama(path, heads=4, kv_heads=2, layers=6, hidden=64, seed=0, max_positions=1024):
    """A random Llama in HF layout, with SmolLM2's tokenizer and chat template (so the
    vocabulary matches)."""
    path.mkdir(parents=True, exist_ok=True)
    smol = resolve_model("smollm2-135m")
    for f in smol.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    vocab, inter, D = 49152, 128, hidden // heads
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    t = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": w(heads * D, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * D, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * D, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * D),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps(
            {
                "vocab_size": vocab,
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "max_position_embeddings": max_positions,
                "tie_word_embeddings": False,
                "eos_token_id": 2,
            }
        )
    )
    return path


def attach_kv(model, num_slots: int, max_len: int, drafter: bool = False) -> KVCache:
    """A fp32 CPU KV cache of num_slots requests of max_len tokens (the pool holds them all),
    bound to the model's attention (a drafter's one layer with drafter=True)."""
    layers = 1 if drafter else model.cfg.num_hidden_layers
    num_blocks = num_slots * -(-max_len // 16)
    shape = KVShape.of(model.cfg, 1, layers)
    kv = KVCache(shape, None, num_slots, max_len, num_blocks, 16, torch.float32, "cpu")
    kv.bind([model.midlayer.self_attn] if drafter else model.attention_modules())
    return kv


def prefill_batch(kv: KVCache, slots: list[int], positions: torch.Tensor, kv_len: int):
    """A ForwardBatch writing every token of rows in `slots` at `positions` [B, T]."""
    valid = torch.ones_like(positions, dtype=torch.bool)
    return kv.batch(torch.tensor(slots), positions, valid, kv_len)
