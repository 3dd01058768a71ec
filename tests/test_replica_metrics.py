"""/metrics and /health answer for every replica, not the one a call reaches (two replicas of a
tiny random model)."""

import httpx
import pytest
from prom_text import label_sets, scrape_until, total
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


def test_every_replica_is_reported(base_url):
    """Each replica's series, labelled by replica; their sums are the requests sent."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    body["ignore_eos"] = True
    for _ in range(12):  # the router spreads them over both replicas
        assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200
    health = httpx.get(f"{base_url}/health", timeout=30).json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2

    def finished(samples):  # the reports after each request come asynchronously
        return total(samples, "vllm:e2e_request_latency_seconds_count") == 12

    samples = scrape_until(base_url, finished)
    replicas = set(health["replicas"])
    assert total(samples, "eagleserve_replicas", model_name=MODEL) == 2
    for name in ("eagleserve_engine_steps_total", "vllm:request_success_total"):
        assert {ls["replica"] for ls in label_sets(samples, name)} == replicas, name
    served = {
        r: total(samples, "vllm:e2e_request_latency_seconds_count", replica=r) for r in replicas
    }
    assert all(n > 0 for n in served.values()), served  # both served, both are counted
    assert total(samples, "vllm:request_success_total", finished_reason="length") == 12
    assert total(samples, "vllm:generation_tokens_total") == 12 * 8
    assert all(total(samples, "eagleserve_healthy", replica=r) == 1 for r in replicas)
