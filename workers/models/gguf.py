"""GGUF files (llama.cpp's format): reading one into Hugging Face names and config, and
converting it once into a cached safetensors directory."""

import fcntl
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class GGUFArchitecture:
    """What one llama.cpp architecture name means: the Hugging Face family, whether llama.cpp
    interleaved the q/k rows for its rope (Llama) or kept them (Qwen2, NeoX-style rope), and the
    layer tensors it stores (a name map per architecture)."""

    hf_architecture: str
    model_type: str
    permuted_qk: bool
    layer_names: dict[str, str]


ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", True, _GGUF_LAYER_NAMES),
    "qwen2": GGUFArchitecture(
        "Qwen2ForCausalLM",
        "qwen2",
        False,
        _GGUF_LAYER_NAMES
        | {f"{n}.bias": f"{_GGUF_LAYER_NAMES[n]}.bias" for n in ("attn_q", "attn_k", "attn_v")},
    ),
}
_GGUF_REQUIRED = (
    "attention.head_count",
    "embedding_length",
    "feed_forward_length",
    "block_count",
    "attention.layer_norm_rms_epsilon",
)
ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rope; undo it to the HF rotate-half order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError) as e:  # what numpy says about a short or foreign file
        raise ValueError(f"{path} is truncated or not a GGUF ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {list(ARCHITECTURES)})"
        )
    missing = [f"{arch}.{key}" for key in _GGUF_REQUIRED if f"{arch}.{key}" not in reader.fields]
    if missing:
        raise ValueError(f"{path}: GGUF lacks metadata {', '.join(missing)}")
    return reader, arch


def _rope_scaling(reader, arch: str, path: Path) -> dict | None:
    """GGUF rope scaling metadata -> a config.json rope_scaling (None: plain RoPE)."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor", 0.0)
    if kind not in ROPE_SCALING_TYPES or (kind == "none" and factor not in (0.0, 1.0)):
        key, value = ("type", kind) if kind not in ROPE_SCALING_TYPES else ("factor", factor)
        raise ValueError(
            f"{path}: GGUF metadata {arch}.rope.scaling.{key} = {value!r} is not supported"
        )
    if kind == "none":
        return None
    rope = {"rope_type": kind, "factor": float(factor)}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        rope["original_max_position_embeddings"] = int(original)
    return rope


def _gguf_config(reader, arch: str, path: Path) -> dict:
    """The config.json of a GGUF's metadata (vocabulary and tie filled in from its tensors)."""
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    # what the model code does not run (partial rotary, other value heads) is refused
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        value = _field(reader, key)
        if value is not None and value != head_dim:
            raise ValueError(
                f"{path}: GGUF metadata {key} = {value!r} is not supported (only {head_dim!r})"
            )
    return {
        "architectures": [ARCHITECTURES[arch].hf_architecture],
        "model_type": ARCHITECTURES[arch].model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch, path),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32",
    }


def _hf_name(name: str, layout: GGUFArchitecture, path: Path) -> str:
    parts = name.split(".")
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    leaf = ".".join(parts[2:-1]) if parts[-1] == "weight" else ".".join(parts[2:])
    target = layout.layer_names.get(leaf)
    if len(parts) >= 4 and parts[0] == "blk" and parts[1].isdigit() and target:
        suffix = "" if parts[-1] != "weight" else ".weight"
        return f"model.layers.{parts[1]}.{target}{suffix}"
    raise ValueError(f"{path}: unsupported tensor {name}")


def _read_tensor(t, config: dict, layout: GGUFArchitecture, path: Path) -> np.ndarray:
    import gguf

    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if layout.permuted_qk and kind in ("attn_q", "attn_k"):
        n = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
        if w.shape[0] != n * config["head_dim"]:
            raise ValueError(
                f"{path}: tensor {t.name} has {w.shape[0]} rows, not {n} heads x "
                f"{config['head_dim']}"
            )
        w = _unpermute_rope(w, n)
    return w


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A llama or qwen2 GGUF -> (HF config dict, HF-named fp32 tensors). Quantized tensors are
    dequantized; Llama 3.1's rope_freqs.weight becomes the config's per-frequency divisors."""
    reader, arch = _open(path)
    config, layout = _gguf_config(reader, arch, path), ARCHITECTURES[arch]
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        if t.name == "rope_freqs.weight":
            _set_rope_freqs(config, _read_tensor(t, config, layout, path), path)
            continue
        name = _hf_name(t.name, layout, path)
        w = _read_tensor(t, config, layout, path)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{path}: GGUF lacks tensor token_embd.weight")
    config["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return config, tensors


def _set_rope_freqs(config: dict, factors: np.ndarray, path: Path) -> None:
    """rope_freqs.weight: llama.cpp's per-frequency divisors of the base frequencies (how it
    stores Llama 3's rope scaling); all ones is plain RoPE."""
    if np.all(factors == 1):
        return
    if config["rope_scaling"] is not None or factors.shape != (config["head_dim"] // 2,):
        raise ValueError(
            f"{path}: rope_freqs.weight of shape {list(factors.shape)} with rope scaling "
            f"{config['rope_scaling']} is not supported"
        )
    config["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors.tolist()}


def save_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    """The GGUF's tokenizer, when it has one (without, the engine works on token ids)."""
    from transformers import AutoTokenizer

    reader, _ = _open(gguf_path)
    if "tokenizer.ggml.model" not in reader.fields:
        return

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
