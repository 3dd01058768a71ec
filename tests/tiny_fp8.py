"""Tiny FP8 checkpoints, written in the layouts the FP8 checkpoints users bring have, from a tiny
float checkpoint (imported, not fixtures):

- `fp8-tensor`: vLLM's `quant_method: "fp8"` (AutoFP8's and llm-compressor's older exports, read
  by vLLM's Fp8Config.from_config and Fp8LinearMethod.create_weights): each linear's `weight`
  in float8_e4m3fn and `weight_scale`, a float32 number; `activation_scheme: "dynamic"`.
- `ct-channel` / `ct-tensor`: compressed-tensors' FP8_DYNAMIC scheme as llm-compressor saves it
  (compressed-tensors 0.20: quant_scheme.FP8_DYNAMIC, NaiveQuantizationCompressor's `weight` and
  `weight_scale`, format `float-quantized`): weight scales in the model's dtype, [out, 1] per
  channel or [1] per tensor; `lm_head` ignored. With kv_scales, a `kv_cache_scheme` and each
  layer's `self_attn.k_scale` / `v_scale`.

`dequantized_twin` writes the float checkpoint each one stands for (weight x scale), the
reference the FP8 model is held to."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
FP8_ARGS |= {"actorder": None, "block_structure": None, "observer_kwargs": {}}


def fp8_args(strategy: str, dynamic: bool) -> dict:
    observer = None if dynamic else "minmax"
    return FP8_ARGS | {"strategy": strategy, "dynamic": dynamic, "observer": observer}


def quantization_config(layout: str, kv_scales: bool = False) -> dict:
    if layout == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": None}
    strategy = layout.removeprefix("ct-")
    group = {
        "targets": ["Linear"],
        "weights": fp8_args(strategy, dynamic=False),
        "input_activations": fp8_args("token", dynamic=True),
        "output_activations": None,
    }
    kv_scheme = fp8_args("tensor", dynamic=False) if kv_scales else None
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": kv_scheme,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "version": "0.20.1",
    }


def quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, its scale as the layout stores it)."""
    w = w.float()
    if layout == "ct-channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).to(torch.bfloat16)
    elif layout == "ct-tensor":
        scale = (w.abs().amax().reshape(1) / 448).to(torch.bfloat16)
    else:
        scale = w.abs().amax() / 448  # float32, shape []
    return (w / scale.float()).clamp(-448, 448).to(FP8), scale


def write_fp8(src: Path, out: Path, layout: str | None, kv_scales: bool = False) -> Path:
    """The float checkpoint `src` in FP8 `layout` (None: its weights as they are), with the
    rest of its directory."""
    out = Path(out)
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        if layout is not None:
            tensors[name], tensors[name + "_scale"] = quantize(tensors[name], layout)
    if kv_scales:  # scales near each layer's key and value magnitudes
        for i in range(json.loads((out / "config.json").read_text())["num_hidden_layers"]):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 + 0.01 * i)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02 + 0.01 * i)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    if layout is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = quantization_config(layout, kv_scales)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def dequantized_twin(fp8_dir: Path, out: Path) -> Path:
    """The float32 checkpoint an FP8 one stands for: every weight times its scale."""
    out = Path(out)
    shutil.copytree(fp8_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    plain = {}
    for name, t in tensors.items():
        if name.endswith("_scale"):
            continue
        scale = tensors.get(name + "_scale")
        plain[name] = t.float() * scale.float() if scale is not None else t.float()
    save_file(plain, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
