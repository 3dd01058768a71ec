"""`eagleserve train-drafter`: self-distill the data (once), then train and export the drafter."""
import gc
import logging
import time
from pathlib import Path

import torch

from speculative.train.config import TrainConfig
from speculative.train.data import TokenStore, self_distill
from speculative.train.trainer import train

log = logging.getLogger(__name__)


def distill(cfg: TrainConfig) -> TokenStore:
    """Regenerate the training responses with the target through our own engine."""
    from speculative.config import EngineConfig
    from speculative.engine import LLMEngine
    d = cfg.distill
    if not d.prompt_files:
        raise ValueError(f"no data file at {cfg.data} and no prompt files to generate it from")
    max_len = d.max_prompt_len + d.max_tokens + 1
    engine = LLMEngine(EngineConfig(
        model=cfg.model, drafter="none", device=cfg.device, max_batch_size=d.max_batch_size,
        # the runner pads a prefill batch to its longest prompt: budget for the padded size
        max_model_len=max_len, max_num_batched_tokens=max(max_len, d.max_batch_size * d.max_prompt_len)))
    start = time.perf_counter()
    store = self_distill(engine, d)
    seconds = time.perf_counter() - start
    num_response = int(store.lengths.sum() - store.prompt_lens.sum())
    log.info("self-distillation: %d sequences, %d response tokens in %.0f s (%.0f tokens/s)",
             len(store), num_response, seconds, num_response / max(seconds, 1e-9))
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return store


def train_drafter(cfg: TrainConfig) -> dict:
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_config.json").write_text(cfg.model_dump_json(indent=2))
    if not Path(cfg.data).is_file():
        distill(cfg).save(Path(cfg.data))
    return train(cfg)
