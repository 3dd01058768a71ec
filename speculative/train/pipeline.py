"""`eagleserve train-drafter`: self-distill the data (when there is none, or more with
`distill_only`), then train and export the drafter."""

import gc
import json
import logging
import time
from pathlib import Path

import torch

from speculative.train.config import TrainConfig
from speculative.train.data import TokenStore, data_parts, load_data, save_parts
from speculative.train.distill import self_distill, self_distill_in_processes
from speculative.train.trainer import check_config, train

log = logging.getLogger(__name__)


def distill(cfg: TrainConfig) -> TokenStore:
    """Regenerate training responses with the target through our own engine, continuing after the
    prompts that the parts already in the data directory cover."""
    from speculative.config import EngineConfig
    from speculative.engine.llm_engine import LLMEngine
    from workers.device import pick_device, pick_dtype
    from workers.kv_sizing import full_length_gb
    from workers.models import ModelConfig
    from workers.models.loader import resolve_model

    d = cfg.distill
    if not d.prompt_files:
        raise ValueError(
            f"no self-distilled data in {cfg.data_dir} and no prompt files to generate it from"
        )
    skip = d.skip_prompts + (len(load_data(cfg.data_dir)) if data_parts(cfg.data_dir) else 0)
    max_len = d.max_prompt_len + d.max_tokens + 1
    # every slot at full length, not gpu_memory_utilization's share of the GPU: engines sharing
    # one (num_workers) start together, and each would count the others' memory as its own
    dtype = pick_dtype("auto", pick_device(cfg.device))
    target_cfg = ModelConfig.from_dir(resolve_model(cfg.model))
    engine_cfg = EngineConfig(
        model=cfg.model,
        drafter="none",
        device=cfg.device,
        max_batch_size=d.max_batch_size,
        # the runner pads a prefill batch to its longest prompt: budget for the padded size
        max_model_len=max_len,
        max_num_batched_tokens=max(max_len, d.max_batch_size * d.max_prompt_len),
        kv_cache_memory_gb=full_length_gb(target_cfg, d.max_batch_size, max_len, dtype),
    )
    start = time.perf_counter()  # the engines' start counts: it is part of every job's time
    if d.num_workers > 1:
        store = self_distill_in_processes(engine_cfg, d, skip)
    else:
        engine = LLMEngine(engine_cfg)
        store = self_distill(engine, d, skip)
        del engine
    seconds = time.perf_counter() - start
    num_response = int(store.lengths.sum() - store.prompt_lens.sum())
    log.info(
        "self-distillation in %d process(es): %d sequences after the %d prompts of earlier parts, "
        "%d response tokens in %.0f s with the engines' start (%.0f tokens/s)",
        d.num_workers,
        len(store),
        skip,
        num_response,
        seconds,
        num_response / max(seconds, 1e-9),
    )
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return store


def train_drafter(cfg: TrainConfig, distill_only: bool = False) -> dict:
    """Distil when the data directory is empty, then train; with `distill_only`, add the parts of
    one more distillation run and stop (returns what the directory then holds). With
    `cfg.synthesize`, the target writes the data itself instead (`train_on_synthesized`)."""
    if cfg.synthesize is not None:
        return train_on_synthesized(cfg, data_only=distill_only)
    if distill_only or not (cfg.corpora or data_parts(cfg.data_dir)):
        if not distill_only:
            check_config(cfg)  # its errors now, not after minutes of distilling
        store = distill(cfg)
        if len(store):
            log.info("wrote %s", ", ".join(str(p) for p in save_parts(cfg.data_dir, store)))
        else:
            log.warning("no prompts left to distil after the ones %s covers", cfg.data_dir)
    if distill_only:
        data = load_data(cfg.data_dir)
        return {
            "num_parts": len(data_parts(cfg.data_dir)),
            "num_sequences": len(data),
            "num_response_tokens": int(data.lengths.sum() - data.prompt_lens.sum()),
        }
    return train_and_evaluate(cfg)


def train_on_synthesized(cfg: TrainConfig, data_only: bool = False) -> dict:
    """Synthesize (continuing the corpus an earlier run began) until the corpus is complete, then
    train. A run that the synthesis time limit stops returns before training: run it again."""
    from speculative.train.corpus import synthesize_data

    if not data_parts(cfg.data_dir):
        check_config(cfg)  # its errors now, not after minutes of synthesis
        synthesis = synthesize_data(cfg)
        if not synthesis["is_complete"]:
            log.warning("the corpus is not complete yet: run again to continue it")
        if data_only or not synthesis["is_complete"]:
            return {"synthesis": synthesis}
    elif data_only:
        return {"synthesis": {"is_complete": True, "num_sequences": len(load_data(cfg.data_dir))}}
    return train_and_evaluate(cfg)


def train_and_evaluate(cfg: TrainConfig) -> dict:
    """Train, export, and (with eval_prompt_files) measure the exported drafter's acceptance."""
    from speculative.train.evaluate import exported_acceptance

    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_config.json").write_text(cfg.model_dump_json(indent=2))
    summary = train(cfg)
    if cfg.eval_prompt_files:
        summary["acceptance"] = exported_acceptance(cfg)
        (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
