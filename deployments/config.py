"""The serving configuration: one pydantic model, loadable from YAML."""

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, field_validator

from speculative.config import EngineConfig


class AutoscalingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig = EngineConfig()
    served_model_name: str | None = None  # defaults to engine.model
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingConfig | None = None  # replaces num_replicas when set
    max_waiting_requests: int = Field(64, ge=1)  # per replica; beyond it requests get 429
    max_ongoing_requests: int = Field(256, ge=1)  # per replica, Serve's own limit
    api_key: str | None = None  # or EAGLESERVE_API_KEY; None means no auth
    max_request_bytes: int = Field(1 << 20, ge=1024)
    resume_timeout_s: float = Field(
        30.0, ge=0
    )  # a stream whose replica fails goes on elsewhere; 0: off
    hung_step_s: float = Field(30.0, gt=0)  # a step running longer fails the health check
    # what each tensor-parallel rank's placement bundle reserves (e.g. {"CPU": 4, "GPU": 1}); it
    # must hold what the rank takes (1 GPU on GPUs, 1 CPU on CPUs). None: exactly that
    rank_resources: dict[str, NonNegativeFloat] | None = None
    ray_address: str | None = None  # join a cluster instead of starting local Ray
    # ---- issue 31b: chat templates and tool calls ----
    chat_template: str | None = None  # a Jinja template file replacing the model's
    # how replies' tool calls are read; None: chosen from the chat template (deployments/tools.py)
    tool_call_parser: Literal["hermes", "llama3_json", "json"] | None = None
    reasoning_parser: Literal["think"] | None = None  # "think": <think> text is `reasoning`

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, path):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"chat_template {path!r} is not a file")
        return path

    # ---- end issue 31b ----
    # the defaults of a request's unset sampling fields (deployments/generation_config.py): "auto"
    # the model's generation_config.json, "vllm" none, else a directory holding one
    generation_config: str = "auto"

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, source):
        if source not in ("auto", "vllm") and not Path(source).is_dir():
            raise ValueError(f"generation_config {source!r} is not auto, vllm or a directory")
        return source

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("EAGLESERVE_API_KEY") or None


def load_config(path: str | Path | None, **overrides) -> ServeConfig:
    """YAML file (optional) + command-line overrides (`engine.*` keys go to the engine)."""
    data = yaml.safe_load(Path(path).read_text()) or {} if path else {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping")
    engine = dict(data.get("engine") or {})
    for key, value in overrides.items():
        if value is None:
            continue
        if key.startswith("engine."):
            engine[key.removeprefix("engine.")] = value
        else:
            data[key] = value
    data["engine"] = engine
    return ServeConfig.model_validate(data)
