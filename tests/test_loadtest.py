"""`eagleserve loadtest` against a real Ray Serve app (a tiny random Llama with SmolLM2's tokenizer,
on loopback): counts, latencies and error kinds, the JSON/plot output, the loopback-only guard."""

import asyncio
import http.server
import json
import subprocess
import sys
import threading

import pytest
from prom_text import scrape, total
from serve_app import start_app, stop_app
from tiny_models import tiny_llama

from deployments import loadtest
from deployments.cli import main
from deployments.config import ServeConfig
from deployments.prompt_sets import load_prompts
from workers.distributed import free_port

KEY = "loadtest-key"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    model = str(tiny_llama(tmp_path_factory.mktemp("loadtest") / "tiny"))
    cfg = ServeConfig(
        engine={
            "model": model,
            "drafter": "none",
            "max_batch_size": 8,
            "max_model_len": 512,
            "device": "cpu",
        },
        served_model_name="tiny",
        api_key=KEY,
    )
    url = start_app(cfg, num_cpus=2)
    yield url
    stop_app()


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(None, 8)  # the shipped GSM8K test questions


def _run(base_url, prompts, **kw):
    args = (
        dict(model="tiny", max_tokens=MAX_TOKENS, ignore_eos=True, api_key=KEY, timeout_s=60) | kw
    )
    return loadtest.loadtest(base_url, prompts, **args)


def _completion_tokens(base_url) -> float:
    return total(scrape(base_url), "vllm:generation_tokens_total")


def test_sweep_all_ok_and_tokens_match_the_server(base_url, prompts):
    before = _completion_tokens(base_url)
    runs = _run(base_url, prompts, concurrency=[1, 4], num_requests=8)
    assert [r["concurrency"] for r in runs] == [1, 4]
    for r in runs:
        assert r["num_ok"] == r["num_requests"] == 8 and r["errors"] == {}
        assert r["output_tokens"] == 8 * MAX_TOKENS
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
        assert (
            r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"] and r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        )
        assert r["itl_ms"]["p50"] is not None
    assert _completion_tokens(base_url) - before == sum(r["output_tokens"] for r in runs)


def test_each_request_is_timed_in_order(base_url, prompts):
    bodies = [
        loadtest.request_body("completions", "tiny", p, MAX_TOKENS, 0.0, True) for p in prompts[:4]
    ]
    results, wall_s = asyncio.run(loadtest.run_level(base_url, bodies, concurrency=2, api_key=KEY))
    assert len(results) == 4
    for r in results:
        assert r.error is None and r.num_tokens == MAX_TOKENS  # usage.completion_tokens
        assert r.sent <= r.first <= r.chunks[-1] <= r.done and 1 <= len(r.chunks) <= MAX_TOKENS
        assert r.done - r.sent <= wall_s


def test_poisson_rate_and_duration_bound(base_url, prompts):
    [r] = _run(base_url, prompts, rate=[20.0], num_requests=6)
    assert r["rate"] == 20.0 and r["num_ok"] == 6
    [r] = _run(base_url, prompts, concurrency=[2], num_requests=10_000, duration_s=1.0)
    assert 0 < r["num_ok"] == r["num_requests"] < 10_000 and r["wall_s"] < 30


def test_errors_are_counted_by_kind(base_url, prompts):
    [r] = _run(base_url, prompts, concurrency=[2], num_requests=4, api_key="wrong-key")
    assert r["num_ok"] == 0 and r["errors"] == {"401": 4} and r["ttft_ms"]["p50"] is None
    [r] = _run(base_url, prompts, concurrency=[2], num_requests=2, timeout_s=0.001)
    assert r["errors"] == {"timeout": 2}
    [r] = _run(f"http://127.0.0.1:{free_port()}", prompts, concurrency=[1], num_requests=2)
    assert r["errors"] == {"connection": 2}


def test_cli_writes_table_json_and_plot(base_url, tmp_path, capsys):
    out = tmp_path / "lt.json"
    main(
        [
            "loadtest",
            "--url",
            f"{base_url}/v1",
            "--model",
            "tiny",
            "--api-key",
            KEY,
            "--concurrency",
            "1,4",
            "--num-requests",
            "8",
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
            "-o",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "concurrency" in printed and "ttft p50" in printed and f"results: {out}" in printed
    data = json.loads(out.read_text())
    assert data["url"] == base_url and data["model"] == "tiny" and len(data["runs"]) == 2
    for r in data["runs"]:
        assert {
            "concurrency",
            "num_requests",
            "num_ok",
            "errors",
            "output_tokens",
            "wall_s",
            "output_tokens_per_s",
            "requests_per_s",
            "ttft_ms",
            "itl_ms",
            "e2e_ms",
        } <= r.keys()
        assert {"p50", "p99"} <= r["ttft_ms"].keys() and r["num_ok"] == 8
    assert out.with_suffix(".png").stat().st_size > 0


def test_non_loopback_url_is_refused():
    proc = subprocess.run(
        [sys.executable, "-m", "deployments.cli", "loadtest", "--url", "http://10.1.2.3:8000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "not loopback" in proc.stderr and "--allow-remote" in proc.stderr
    for url in ("http://127.0.0.1:8000/v1", "http://localhost:8000", "http://[::1]:8000"):
        assert loadtest.check_url(url, allow_remote=False).endswith(":8000")
    assert (
        loadtest.check_url("https://cluster.example.com", allow_remote=True)
        == "https://cluster.example.com"
    )
    with pytest.raises(ValueError, match="not an http"):
        loadtest.check_url("127.0.0.1:8000", allow_remote=False)


def test_prompt_files_are_checked(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"question": "b", "prompt": "c"}\n{"turns": ["d"]}\n')
    assert load_prompts(str(path), 10) == [
        "a",
        "c",
        "d",
    ]  # blank lines skipped; "prompt" wins when present
    path.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    with pytest.raises(
        ValueError, match=r"p\.jsonl:2: expected a JSON object with a non-empty prompt"
    ):
        load_prompts(str(path), 10)
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(path), 10)


STREAMS = {  # model name -> the SSE body a misbehaving server sends
    "no-space": 'data:{"choices": [{"text": "hi"}]}\n\n'
    'data:{"choices": [], "usage": {"completion_tokens": 3}}\n\n'
    "data:[DONE]\n\n",
    "null-event": "data: null\n\ndata: [DONE]\n\n",
    "no-usage": 'data: {"choices": [{"text": "a"}]}\n\n'
    'data: {"choices": [{"text": "b"}]}\n\n'
    "data: [DONE]\n\n",
}


class _Misbehaving(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.write(STREAMS[body["model"]].encode())

    def log_message(self, *args):
        pass


def test_a_misbehaving_stream_is_counted_not_a_crash():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Misbehaving)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        runs = {
            m: loadtest.loadtest(
                url,
                ["x"],
                concurrency=[1],
                num_requests=2,
                model=m,
                endpoint="completions",
                timeout_s=10,
            )[0]
            for m in STREAMS
        }
    finally:
        server.shutdown()
    assert (
        runs["no-space"]["num_ok"] == 2 and runs["no-space"]["output_tokens"] == 6
    )  # SSE's space is optional
    assert not runs["no-space"]["tokens_estimated"]
    assert runs["null-event"]["errors"] == {"stream_error": 2}
    assert runs["no-usage"]["output_tokens"] == 4 and runs["no-usage"]["tokens_estimated"]
