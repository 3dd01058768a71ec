"""The hand-over between training slices: runs of under 10 minutes on a machine whose files come
back at most 16 MB each (8 files, 64 MB in all). A slice ends by writing its checkpoint as files
under a size cap (tensors past it split by rows): the drafter's weights in float32, or in
bfloat16 where float32 would not come back; the trainer state (step, schedule, metrics); and,
unless left out, AdamW's moments. The next slice, given the same directory, continues from it:
with the moments and float32 weights exactly as an uncut run would; without them from the same
weights, step, schedule and data order, its moments started afresh."""

import json
import shutil
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculative.drafter_format import read_drafter_config, save_drafter
from workers.models.loader import iter_safetensors

SMALL_FILES = ("config.json", "trainer_state.json", "vocab_coverage.json")


def save_split(tensors: dict[str, torch.Tensor], directory: Path, prefix: str, cap: int) -> None:
    """Files PREFIX-00000.safetensors, ... of at most `cap` bytes; a tensor past it is saved as
    row blocks NAME@0, NAME@1, ..."""
    pieces = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.nbytes <= cap or t.dim() == 0:
            pieces[name] = t
            continue
        rows = max(1, cap // max(t[0].nbytes, 1))
        pieces |= {f"{name}@{i}": part.clone() for i, part in enumerate(t.split(rows))}
    files, size = [{}], 0
    for name, t in pieces.items():
        if files[-1] and size + t.nbytes > cap:
            files.append({})
            size = 0
        files[-1][name] = t
        size += t.nbytes
    for i, part in enumerate(files):
        save_file(part, str(directory / f"{prefix}-{i:05d}.safetensors"))


def load_split(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    whole, blocks = {}, defaultdict(dict)
    for f in sorted(directory.glob(f"{prefix}-*.safetensors")):
        for key, t in load_file(str(f)).items():
            name, at, i = key.rpartition("@")
            if at:
                blocks[name][int(i)] = t
            else:
                whole[key] = t
    return whole | {n: torch.cat([b[i] for i in range(len(b))]) for n, b in blocks.items()}


def write_handover(
    ckpt: Path, out: Path, dtype: torch.dtype, with_optimizer: bool, cap_mb: float
) -> None:
    """The checkpoint in `ckpt` (checkpoint.py's layout) as a hand-over in `out`."""
    cap = int(cap_mb * 1e6)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {n: t.to(dtype) if t.is_floating_point() else t for n, t in iter_safetensors(ckpt)}
    save_split(weights, tmp, "weights", cap)
    if with_optimizer:
        save_split(load_file(str(ckpt / "optimizer" / "optimizer.safetensors")), tmp, "adam", cap)
    for name in SMALL_FILES:
        if (ckpt / name).is_file():
            shutil.copy(ckpt / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def restore_handover(handover: Path, ckpt: Path) -> dict:
    """A checkpoint in `ckpt` rebuilt from a hand-over (float32 weights; the optimizer's file
    only where the hand-over has its moments). -> the trainer state."""
    ckpt.mkdir(parents=True, exist_ok=True)
    weights = {n: t.float() if t.is_floating_point() else t for n, t in
               load_split(handover, "weights").items()}  # fmt: skip
    save_drafter(ckpt, read_drafter_config(handover), weights)
    moments = load_split(handover, "adam")
    if moments:
        (ckpt / "optimizer").mkdir(exist_ok=True)
        save_file(moments, str(ckpt / "optimizer" / "optimizer.safetensors"))
    for name in SMALL_FILES[2:]:
        if (handover / name).is_file():
            shutil.copy(handover / name, ckpt / name)
    shutil.copy(handover / "trainer_state.json", ckpt / "trainer_state.json")  # last: complete
    return json.loads((ckpt / "trainer_state.json").read_text())
