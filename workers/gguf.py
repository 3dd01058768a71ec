"""GGUF files (llama.cpp's format): reading one into Hugging Face names and config, and
converting it once into a cached safetensors directory."""

import fcntl
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

log = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


_GGUF_REQUIRED = (
    "llama.attention.head_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.block_count",
    "llama.attention.layer_norm_rms_epsilon",
)


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rope; undo it to the HF rotate-half order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A llama GGUF -> (HF config dict, HF-named fp32 tensors). Quantized tensors are dequantized."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError) as e:  # what numpy says about a short or foreign file
        raise ValueError(f"{path} is truncated or not a GGUF ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only llama)")
    missing = [key for key in _GGUF_REQUIRED if key not in reader.fields]
    if missing:
        raise ValueError(f"{path}: GGUF lacks metadata {', '.join(missing)}")
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv", heads))
    hidden = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    # what the model code does not run (rope scaling, partial rotary, other value heads) is refused
    for key, allowed in (
        ("llama.attention.value_length", (head_dim,)),
        ("llama.rope.dimension_count", (head_dim,)),
        ("llama.rope.scaling.type", ("none",)),
        ("llama.rope.scaling.factor", (0.0, 1.0)),
    ):
        value = _field(reader, key)
        if value is not None and value not in allowed:
            raise ValueError(
                f"{path}: GGUF metadata {key} = {value!r} is not supported (only {allowed[0]!r})"
            )
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        parts = t.name.split(".")
        if t.name in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[t.name]
        elif t.name == "rope_freqs.weight":  # Llama 3.1 rope scaling as per-frequency divisors
            if not np.all(gguf.quants.dequantize(t.data, t.tensor_type) == 1):
                raise ValueError(
                    f"{path}: rope_freqs.weight (Llama 3 rope scaling) is not supported"
                )
            continue
        elif (
            len(parts) == 4
            and parts[0] == "blk"
            and parts[1].isdigit()
            and parts[2] in _GGUF_LAYER_NAMES
            and parts[3] == "weight"
        ):
            name = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight"
        else:
            raise ValueError(f"{path}: unsupported tensor {t.name}")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if parts[-2] in ("attn_q", "attn_k"):
            n = heads if parts[-2] == "attn_q" else kv_heads
            if w.shape[0] != n * head_dim:
                raise ValueError(
                    f"{path}: tensor {t.name} has {w.shape[0]} rows, not {n} heads x {head_dim}"
                )
            w = _unpermute_rope(w, n)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{path}: GGUF lacks tensor token_embd.weight")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32",
    }
    return config, tensors


def save_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{gguf_path}: cannot convert its tokenizer ({e})") from None
    tokenizer.save_pretrained(str(out))


def convert_gguf_cached(gguf_path: Path, name: str, cache_dir: Path) -> Path:
    """Convert a GGUF file once into a safetensors directory (weights, config, tokenizer) under
    `cache_dir`, keyed by its resolved path: two files of the same name get directories of their
    own."""
    resolved = gguf_path.resolve()
    out = cache_dir / f"{name}-{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"
    stat = resolved.stat()
    stamp = f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Processes starting together (TP ranks, distillation workers) convert once: the first holds
    # the lock, the others wait and find its result. Only the holder writes `tmp`.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "converted_from").is_file() and (out / "converted_from").read_text() == stamp:
            return out
        start = time.perf_counter()
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed conversion
        try:
            tmp.mkdir()
            config, tensors = read_gguf(gguf_path)
            save_file(tensors, str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            save_gguf_tokenizer(gguf_path, tmp)
            (tmp / "converted_from").write_text(stamp)
            shutil.rmtree(out, ignore_errors=True)  # converted from an earlier version of the file
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "converted %s to %s in %.1f s (later starts load the safetensors cache)",
        gguf_path,
        out,
        time.perf_counter() - start,
    )
    return out
