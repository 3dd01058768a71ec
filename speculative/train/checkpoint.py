"""Training checkpoints: a standard fp32 drafter directory, the optimizer's state in safetensors
beside it and JSON metadata (no pickle), written whole and swapped in by renames so that a run
killed at any point leaves a complete checkpoint, and read back to resume."""

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from speculative.drafter import Eagle3Drafter
from speculative.drafter_format import drafter_state_dict, load_drafter, save_drafter
from workers.models import DecoderModel


def checkpoint_state(ckpt: Path) -> dict | None:
    """The trainer state of the checkpoint in `ckpt`, None when there is none."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    # killed between save_checkpoint's renames
    if not ckpt.exists() and (tmp / "trainer_state.json").is_file():
        tmp.rename(ckpt)
    try:
        return json.loads((ckpt / "trainer_state.json").read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise _unreadable(ckpt, e) from e


def save_checkpoint(
    path: Path, drafter: Eagle3Drafter, optimizer, step: int, metrics: dict, max_steps: int
) -> None:
    """Written whole beside `path` (trainer_state.json last), then swapped in by renames: a run
    killed at any point leaves the previous checkpoint or this one (`checkpoint_state` completes
    the swap)."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(tmp, drafter.cfg, drafter_state_dict(drafter))
    if (path / "vocab_coverage.json").is_file():
        shutil.copy(path / "vocab_coverage.json", tmp)
    names = {id(p): n for n, p in drafter.named_parameters()}
    tensors = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"{names[id(p)]}.{key}"] = (
                    value.detach().float().reshape(-1).cpu().contiguous()
                )
    # its own folder: load_drafter reads every *.safetensors beside config.json
    (tmp / "optimizer").mkdir()
    save_file(tensors, str(tmp / "optimizer" / "optimizer.safetensors"))
    (tmp / "trainer_state.json").write_text(
        json.dumps({"step": step, "max_steps": max_steps, "metrics": metrics}, indent=2)
    )
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    ckpt: Path, target: DecoderModel
) -> tuple[Eagle3Drafter, dict[str, torch.Tensor]]:
    """The checkpoint's drafter and optimizer tensors (none from an optimizer-free hand-over: the
    moments start afresh)."""
    moments = ckpt / "optimizer" / "optimizer.safetensors"
    try:
        return (
            load_drafter(ckpt, target_embeddings=target.embed_tokens),
            load_file(str(moments)) if moments.is_file() else {},
        )
    except (OSError, KeyError, RuntimeError, ValueError, SafetensorError) as e:
        raise _unreadable(ckpt, e) from e


def _unreadable(ckpt: Path, e: Exception) -> ValueError:
    return ValueError(f"checkpoint {ckpt} is unreadable ({e}): delete it to start over")


def load_optimizer_state(
    tensors: dict[str, torch.Tensor], drafter: Eagle3Drafter, optimizer
) -> None:
    for name, p in drafter.named_parameters():
        if p.requires_grad and f"{name}.exp_avg" in tensors:
            optimizer.state[p] = {
                "step": tensors[f"{name}.step"].reshape(()).clone(),
                "exp_avg": tensors[f"{name}.exp_avg"].view_as(p).to(p.device),
                "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].view_as(p).to(p.device),
            }
