"""The model's own sampling defaults, as vLLM's `--generation-config` takes them: `auto` reads the
model directory's generation_config.json, a directory's path reads that one's, `vllm` reads none.
A request that leaves a sampling field unset gets the file's value for it (temperature, top_p,
top_k, min_p, repetition_penalty; max_new_tokens is the default max_tokens)."""

import logging
from pathlib import Path

from pydantic import ValidationError

from speculative.config import SamplingParams
from workers.models.config import read_json

# Serve's own logger: in the ingress replica it goes to the replica's log and the driver's terminal
log = logging.getLogger("ray.serve")

# generation_config.json's key -> the request field it is the default of (vLLM's list)
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_config_path(source: str, model_dir) -> Path | None:
    """The file `source` names (None for `vllm`); `auto` without one in the model is None too."""
    if source == "vllm":
        return None
    path = Path(model_dir if source == "auto" else source) / "generation_config.json"
    if source != "auto" and not path.is_file():
        raise ValueError(f"generation_config {source!r}: no generation_config.json in it")
    return path if path.is_file() else None


def generation_defaults(source: str, model_dir) -> dict:
    """The request fields' defaults from the generation config `source` names ({} for `vllm`),
    checked against the engine's bounds (ValueError naming the file and the field)."""
    path = generation_config_path(source, model_dir)
    if path is None:
        return {}
    config = read_json(path)
    defaults = {FIELDS[k]: v for k, v in config.items() if k in FIELDS and v is not None}
    try:
        SamplingParams.model_validate(defaults)
    except ValidationError as e:
        error = e.errors()[0]
        key = next(k for k, v in FIELDS.items() if v == error["loc"][0])
        raise ValueError(f"{path}: {key}: {error['msg']}") from None
    if defaults:
        log.warning(
            "Default sampling parameters have been overridden by the model's generation config "
            "(%s): %s. A request's own values win; --generation-config vllm turns this off.",
            path,
            defaults,
        )
    return defaults
