"""The drafter training loop: frozen target recomputed per batch, TTT loss, AdamW with warmup and
cosine decay, periodic checkpoints (a standard fp32 drafter directory + optimizer state in
safetensors + JSON metadata, no pickle), resume, and export in the standard EAGLE-3 format."""

import json
import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from speculative.drafter import DrafterConfig, Eagle3Drafter
from speculative.drafter_format import (
    drafter_state_dict,
    save_drafter,
)
from speculative.drafter_int8 import quantize_int8
from speculative.train.checkpoint import (
    checkpoint_state,
    load_checkpoint,
    load_optimizer_state,
    save_checkpoint,
)
from speculative.train.config import TrainConfig
from speculative.train.data import TokenStore, batches, collate
from speculative.train.drafter_init import init_drafter, load_source, load_target
from speculative.train.handover import restore_handover, write_handover
from speculative.train.mix import Mix, load_corpora
from speculative.train.target import target_draft_probs, target_features
from speculative.train.ttt import loss_rows, ttt_forward, ttt_loss
from workers.device import pick_device, pick_dtype
from workers.models import DecoderModel, ModelConfig, load_config
from workers.models.loader import resolve_model

log = logging.getLogger(__name__)


def check_config(cfg: TrainConfig) -> None:
    """The errors of a training config that would otherwise show only after distilling."""
    target_cfg = ModelConfig.from_hf(load_config(resolve_model(cfg.model)))
    if cfg.draft_vocab_size > target_cfg.vocab_size:
        raise ValueError(
            f"draft_vocab_size {cfg.draft_vocab_size} is larger than the vocabulary of "
            f"{cfg.model} ({target_cfg.vocab_size} tokens)"
        )
    if cfg.init_from:
        if checkpoint_state(cfg.checkpoint_dir):
            raise ValueError(
                f"{cfg.checkpoint_dir} holds a checkpoint to resume, which init_from would not "
                f"start from: delete {cfg.checkpoint_dir} to start from {cfg.init_from}, or leave "
                "init_from out to resume"
            )
        load_source(cfg.init_from, target_cfg)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
    return cfg.lr * (
        cfg.min_lr_ratio
        + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    )


def train_step(
    cfg: TrainConfig,
    target: DecoderModel,
    drafter: Eagle3Drafter,
    draft_to_target,
    batch,
    device,
    dtype,
):
    ids, lengths, prompt_lens = batch
    # host: no GPU sync
    rows, row_weight = loss_rows(lengths, prompt_lens, ids.shape[1], cfg.prompt_loss_weight)
    ids, rows, row_weight = (x.to(device, non_blocking=True) for x in (ids, rows, row_weight))
    hidden, aux = target_features(target, ids)  # [B, T, H], [B, T, 3H]
    # row t learns the target's distribution at t+1, inside the sequence as x[t+2] exists
    probs, is_in_draft = target_draft_probs(target, hidden.flatten(0, 1)[rows + 1], draft_to_target)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        hiddens = ttt_forward(drafter, ids, aux, cfg.ttt_steps)
        return ttt_loss(
            hiddens, drafter.lm_head, probs, is_in_draft, rows, row_weight, cfg.step_decay
        )


def batch_stream(cfg: TrainConfig, store: TokenStore, skip: int, mix: Mix | None = None):
    """(epoch, sequence indices) forever, the same order on every run, the first `skip` dropped."""
    epoch, seen = 0, 0
    while True:
        for indices in batches(store, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, epoch, mix):
            if seen >= skip:
                yield epoch, indices
            seen += 1
        epoch += 1


def _setup(cfg: TrainConfig, device, dtype):
    check_config(cfg)
    store, mix = load_corpora(cfg)
    if mix is not None:
        log.info("training on a mix: %s", mix.describe())
    ckpt = cfg.checkpoint_dir
    state = checkpoint_state(ckpt)
    handover = Path(cfg.handover) if cfg.handover else None
    if not state and handover and (handover / "trainer_state.json").is_file():
        state = restore_handover(handover, ckpt)
        log.info("continuing the hand-over in %s at step %d", handover, state["step"])
    # the target captures the aux layers of the drafter it trains (those inference captures for it)
    drafter_dir = ckpt if state else cfg.init_from
    aux = (
        DrafterConfig.from_hf(load_config(Path(drafter_dir))).aux_layer_ids if drafter_dir else None
    )
    target = load_target(cfg.model, device, dtype, aux)
    if state:
        drafter, optimizer_tensors = load_checkpoint(ckpt, target)
    else:
        drafter = init_drafter(cfg, target, store, ckpt)
    drafter.to(device)
    params = [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
    )
    if state:
        load_optimizer_state(optimizer_tensors, drafter, optimizer)
        log.info("resumed from %s at step %d", ckpt, state["step"])
        if state["step"] >= state["max_steps"]:
            log.warning(
                "the checkpoint in %s is complete: nothing to train (delete it to start over)", ckpt
            )
    return (
        store,
        mix,
        target,
        drafter,
        optimizer,
        params,
        ckpt,
        state or {"step": 0, "max_steps": cfg.max_steps},
    )


def train(cfg: TrainConfig) -> dict:
    """Train (resuming from the checkpoint when there is one) and export. Returns the summary."""
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    store, mix, target, drafter, optimizer, params, ckpt, state = _setup(cfg, device, dtype)
    step, metrics = state["step"], state.get("metrics", {})
    # a fitted schedule is kept on resume; otherwise the config decides (and may extend a run)
    schedule = (
        cfg.model_copy(update={"max_steps": state["max_steps"]}) if cfg.fit_steps_to_time else cfg
    )
    if cfg.num_epochs is not None:  # every epoch has as many batches: their order differs only
        num_batches = len(batches(store, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, 0, mix))
        epoch_steps = max(1, math.ceil(cfg.num_epochs * num_batches))
        schedule = schedule.model_copy(update={"max_steps": min(schedule.max_steps, epoch_steps)})
    draft_to_target = (
        torch.arange(drafter.cfg.draft_vocab_size, device=device) + drafter.d2t
    ).long()
    stream = batch_stream(cfg, store, step, mix)
    start, first_step, mark_s = time.perf_counter(), step, 0.0
    bar = tqdm(total=schedule.max_steps, initial=step, desc="training drafter", unit="step")
    while step < schedule.max_steps:
        epoch, indices = next(stream)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(schedule, step)
        loss, accuracy = train_step(
            cfg,
            target,
            drafter,
            draft_to_target,
            collate(store, indices, cfg.max_seq_len),
            device,
            dtype,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        elapsed = time.perf_counter() - start
        if cfg.fit_steps_to_time and cfg.time_limit_s and (step - first_step) % 40 == 0:
            # Refit every 40 steps from the rate of the last 40: the first tens of steps run
            # several times slower (kernels picked for new shapes), so one early estimate stops
            # far too soon.
            rate = 40 / (elapsed - mark_s)
            fitted = step + int((cfg.time_limit_s - elapsed) * rate)
            schedule = schedule.model_copy(
                update={"max_steps": max(step + 1, min(cfg.max_steps, fitted))}
            )
            bar.total = schedule.max_steps
            log.debug("fitted the schedule to the time limit: %d steps", schedule.max_steps)
        if (step - first_step) % 40 == 0:
            mark_s = elapsed
        if step % 10 == 0 or step == schedule.max_steps:
            metrics = {
                "loss": round(loss.item(), 4),
                "epoch": epoch,
                "accuracy": [round(a, 4) for a in accuracy.tolist()],
                "loss_history": metrics.get("loss_history", [])[-99:] + [round(loss.item(), 4)],
            }
            bar.set_postfix(
                loss=metrics["loss"], acc0=metrics["accuracy"][0], acc_last=metrics["accuracy"][-1]
            )
        stop = (cfg.time_limit_s is not None and elapsed > cfg.time_limit_s) or (
            cfg.max_steps_this_run is not None and step - first_step >= cfg.max_steps_this_run
        )
        if step % cfg.checkpoint_every == 0 or step == schedule.max_steps or stop:
            save_checkpoint(ckpt, drafter, optimizer, step, metrics, schedule.max_steps)
        if stop:
            break
    bar.close()
    return export(cfg, drafter, step, schedule.max_steps, metrics, time.perf_counter() - start)


def export(
    cfg: TrainConfig,
    drafter: Eagle3Drafter,
    step: int,
    max_steps: int,
    metrics: dict,
    train_s: float,
) -> dict:
    if cfg.handover:
        weights = torch.bfloat16 if cfg.handover_dtype == "bfloat16" else torch.float32
        out, cap_mb = Path(cfg.handover), cfg.export_shard_mb or 15.0
        write_handover(cfg.checkpoint_dir, out, weights, cfg.handover_optimizer, cap_mb)
    out = Path(cfg.output)
    state, dtype = (
        drafter_state_dict(drafter),
        {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(cfg.export_dtype),
    )
    if cfg.export_dtype == "int8":
        state = quantize_int8(state)
    max_shard_bytes = int(cfg.export_shard_mb * 1e6) if cfg.export_shard_mb else None
    save_drafter(out, drafter.cfg, state, dtype, max_shard_bytes)
    (out / "training_config.json").write_text(cfg.model_dump_json(indent=2))
    summary = {
        "step": step,
        "max_steps": max_steps,
        "is_complete": step >= max_steps,
        "train_s_this_run": round(train_s, 1),
        "metrics": metrics,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
