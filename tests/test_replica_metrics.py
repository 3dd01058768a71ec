"""/metrics and /health answer for every replica, not the one a call reaches (two replicas of a
tiny random model)."""

import time

import httpx
import pytest
from serve_app import start_app, stop_app
from tiny_models import tiny_llama

from deployments.config import ServeConfig

MODEL = "tiny"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    model = str(tiny_llama(tmp_path_factory.mktemp("replicas") / "tiny", layers=2))
    engine = {"model": model, "drafter": "none", "max_model_len": 64, "device": "cpu"}
    cfg = ServeConfig(engine=engine, served_model_name=MODEL, num_replicas=2)
    url = start_app(cfg, num_cpus=4)
    yield url
    stop_app()


def _metrics(base_url) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _per_replica(stats: dict, name: str) -> dict[str, float]:
    prefix = f'eagleserve_{name}{{replica="'
    return {k[len(prefix) : -2]: v for k, v in stats.items() if k.startswith(prefix)}


def test_every_replica_is_reported(base_url):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    for _ in range(12):  # the router spreads them over both replicas
        assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
    health = httpx.get(f"{base_url}/health", timeout=30).json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    deadline = time.time() + 15  # the reports after each request and each health check
    while True:
        stats = _metrics(base_url)
        steps = _per_replica(stats, "replica_engine_steps_total")
        if all(steps.values()) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert stats["eagleserve_replicas"] == 2 and set(steps) == set(health["replicas"])
    assert all(n > 0 for n in steps.values()), steps  # both served, both are counted
    assert stats["eagleserve_engine_steps_total"] == sum(steps.values())
    assert all(_per_replica(stats, "replica_healthy").values())
