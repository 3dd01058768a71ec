"""Quantized checkpoints: which `quantization_config` a model may have, checked while its config
is read (before any weight), and the names its FP8 tensors go by.

Loaded: FP8 (E4M3) weights with per-tensor or per-channel scales and dynamic activations, in the
two layouts vLLM and TensorRT-LLM users bring:
- `quant_method: "fp8"` (vLLM's Fp8Config: AutoFP8, llm-compressor's older exports),
  `activation_scheme: "dynamic"`: `weight` in float8_e4m3fn and `weight_scale`, one number;
- `quant_method: "compressed-tensors"` in the FP8_DYNAMIC scheme of compressed-tensors (what
  llm-compressor writes): every config group's weights `num_bits: 8, type: float, strategy:
  channel | tensor`, its input activations 8-bit float, dynamic, per token; tensors `weight`
  (float8_e4m3fn) and `weight_scale` ([out, 1] per channel, one number per tensor).
Which layers are FP8 is read from the tensors' dtypes (so `ignore` lists are honoured as
written); KV-cache scales (`k_scale`, `v_scale`, `kv_scale`, `k_proj.output_scale`) are read
for an FP8 KV cache. gpt-oss's MXFP4 experts (`quant_method: "mxfp4"`) are dequantized to the
model's dtype at load. Every other method, and every other scheme of these two, is refused by name.
"""

import torch

SUPPORTED = (
    "'fp8' with activation_scheme 'dynamic' and per-tensor weight scales, or "
    "'compressed-tensors' FP8_DYNAMIC (8-bit float weights per channel or per tensor, "
    "dynamic per-token 8-bit float input activations)"
)
FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors' names for FP8 as it is
KV_SCALES = {  # checkpoint name's ending -> the attention's scales it sets (k, v)
    "self_attn.k_scale": (True, False),
    "self_attn.v_scale": (False, True),
    "self_attn.kv_scale": (True, True),
    "self_attn.k_proj.output_scale": (True, False),
    "self_attn.v_proj.output_scale": (False, True),
}


def check_quantization(cfg: dict, refuse) -> str | None:
    """config.json's quantization_config -> its quant_method where loaded (None: none), else
    `refuse(problem)` naming the method or field and what is supported."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise refuse(f"quantization_config must be an object; supported: {SUPPORTED}")
    method = qc.get("quant_method")
    if method == "mxfp4" and cfg.get("model_type") == "gpt_oss":
        return None  # its experts are dequantized at load (workers/models/gpt_oss.py)
    if method == "fp8":
        _check_fp8(qc, refuse)
    elif method == "compressed-tensors":
        _check_compressed_tensors(qc, refuse)
    else:
        raise refuse(
            f"quantization_config.quant_method {method!r} is not supported; supported: {SUPPORTED}"
        )
    return method


def _check_fp8(qc: dict, refuse) -> None:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise refuse(
            f"quant_method 'fp8' with activation_scheme {scheme!r} (static input scales) is not "
            f"supported; supported: {SUPPORTED}"
        )
    if qc.get("weight_block_size") is not None:
        raise refuse(
            f"quant_method 'fp8' with weight_block_size {qc['weight_block_size']} (block-wise "
            f"scales, as DeepSeek-V3 and Qwen3-FP8 write them) is not supported; supported: "
            f"{SUPPORTED}"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"quant_method 'fp8' with fmt {qc['fmt']!r} is not supported (only e4m3)")


def _check_compressed_tensors(qc: dict, refuse) -> None:
    def no(what: str):
        return refuse(f"compressed-tensors {what} is not supported; supported: {SUPPORTED}")

    if qc.get("format", "float-quantized") not in FORMATS:
        raise no(f"format {qc.get('format')!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise no(f"quantization_status {qc['quantization_status']!r} (only 'compressed')")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise no(key)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise no("quantization_config without config_groups")
    for name, group in groups.items():
        _check_group(name, group if isinstance(group, dict) else {}, no)
    kv = qc.get("kv_cache_scheme")
    if kv is not None and not _is_fp8(kv, ("tensor",), dynamic=False):
        raise no(f"kv_cache_scheme {kv}")


def _check_group(name: str, group: dict, no) -> None:
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not _is_fp8(weights, ("channel", "tensor"), dynamic=False):
        raise no(f"config group {name!r} with weights {_describe(weights)}")
    if not _is_fp8(inputs, ("token",), dynamic=True):
        raise no(f"config group {name!r} with input_activations {_describe(inputs)}")
    if group.get("output_activations") is not None:
        raise no(f"config group {name!r} with output_activations")


def _is_fp8(args, strategies: tuple[str, ...], dynamic: bool) -> bool:
    return (
        isinstance(args, dict)
        and args.get("num_bits") == 8
        and args.get("type") == "float"
        and args.get("strategy") in strategies
        and bool(args.get("dynamic")) == dynamic
        and args.get("symmetric", True) is True
    )


def _describe(args) -> str:
    if not isinstance(args, dict):
        return repr(args)
    keys = ("num_bits", "type", "strategy", "dynamic", "symmetric", "group_size")
    return str({k: args.get(k) for k in keys if k in args})


def kv_scale_of(name: str) -> tuple[str, tuple[bool, bool]] | None:
    """A KV-cache scale tensor's name -> (its attention module's path, which of k and v it
    scales); None for any other tensor."""
    path = name.removeprefix("model.")
    for ending, which in KV_SCALES.items():
        if path.endswith("." + ending):
            return path.removesuffix("." + ending) + ".self_attn", which
    return None


# MXFP4 (OCP microscaling): 4-bit E2M1 values, two a byte (the low nibble first), and one E8M0
# scale (a power of two, exponent bias 127) for each run of 32 along the input dimension
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip


def dequantize_mxfp4(blocks, scales):
    """blocks [..., rows, G, 16] uint8, scales [..., rows, G] uint8 -> [..., rows, G * 32]
    float32 (gpt-oss's `*_blocks` and `*_scales`: rows are output features)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {scales.shape}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-3)  # [..., rows, G * 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.repeat_interleave(32, dim=-1).float())
