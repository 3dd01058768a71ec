"""The drafter's int8 storage: each 2-D weight as int8 rows with a float32 scale per row,
`<name>_scale` beside `<name>`. Half the bytes of bfloat16, so a trained drafter fits the
repository's size cap; dequantized to float32 on load (drafter_format.py)."""

import torch


def quantize_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2-D float weight -> int8 rows with a float32 scale each (round(w / scale), scale =
    max|row| / 127); the other float tensors in bfloat16."""
    out = {}
    for name, t in state.items():
        if t.is_floating_point() and t.dim() == 2:
            scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            out[name] = (t.float() / scale).round().to(torch.int8)
            out[name + "_scale"] = scale
        else:
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    return out


def dequantize_int8(
    tensors: dict[str, torch.Tensor], source: str = "drafter"
) -> dict[str, torch.Tensor]:
    """The inverse of `quantize_int8` (float32 weights); tensors without a scale pass through."""
    out = {n: t for n, t in tensors.items() if not n.endswith("_scale")}
    for name in tensors.keys() - out.keys():
        if name.removesuffix("_scale") not in out:
            raise ValueError(
                f"{source}: tensor {name!r} has no weight {name.removesuffix('_scale')!r} beside it"
            )
    for name, t in out.items():
        scale = tensors.get(name + "_scale")
        if scale is not None:
            if t.dim() != 2 or scale.shape != (t.shape[0], 1):
                raise ValueError(
                    f"{source}: {name}_scale has shape {list(scale.shape)}, expected "
                    f"[rows, 1] for its {list(t.shape)} weight"
                )
            out[name] = t.float() * scale.float()
        elif t.dtype == torch.int8:
            raise ValueError(f"{source}: int8 tensor {name!r} has no {name + '_scale'!r} beside it")
    return out
