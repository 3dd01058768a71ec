"""`eagleserve generate` end to end, in a subprocess, on the real SmolLM2."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import bench_questions

ENV = os.environ | {"OMP_NUM_THREADS": os.environ.get("EAGLESERVE_TEST_THREADS", "1")}


def eagleserve(*args, timeout=600, env=ENV) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deployments.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "in.jsonl"
    rows = [{"id": f"q{i}", "prompt": q} for i, q in enumerate(bench_questions(4))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def outputs(prompts_file):
    """Default drafter (speculative), the same with a draft tree, and --drafter none: same prompts,
    greedy. Then the rows with priorities (the last first), one at a time under the priority
    policy."""
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    urgent_last = prompts_file.with_name("priorities.jsonl")
    urgent_last.write_text(
        "".join(json.dumps(r | {"priority": -i}) + "\n" for i, r in enumerate(rows))
    )
    priority = ["--scheduling-policy", "priority", "--max-batch-size", 1]
    out = {}
    for name, source, flags in (
        ("default", prompts_file, []),
        ("tree", prompts_file, ["--draft-siblings", 2]),
        ("none", prompts_file, ["--drafter", "none"]),
        ("priority", urgent_last, priority),
    ):
        path = prompts_file.with_name(f"out-{name}.jsonl")
        proc = eagleserve(
            "generate", source, "-o", path, "--max-tokens", 12, "--max-model-len", 512, *flags
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "wrote 4 rows" in proc.stderr
        out[name] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def test_generate_writes_rows(outputs):
    rows = outputs["default"]
    assert [r["id"] for r in rows] == ["q0", "q1", "q2", "q3"]
    for r in rows:
        assert {"id", "text", "token_ids", "num_tokens", "acceptance_length"} <= r.keys()
        assert r["num_tokens"] == len(r["token_ids"]) and 0 < r["num_tokens"] <= 12
        assert r["text"].strip() and r["acceptance_length"] >= 1.0


def test_drafter_none_is_plain_and_identical(outputs):
    assert all(r["acceptance_length"] == 1.0 for r in outputs["none"])
    for name in ("default", "tree", "priority"):
        assert [r["token_ids"] for r in outputs["none"]] == [r["token_ids"] for r in outputs[name]]
        assert [r["text"] for r in outputs["none"]] == [r["text"] for r in outputs[name]]


@pytest.mark.parametrize(
    "case, content, args, message",
    [
        ("missing", None, [], r"input file .*missing\.jsonl does not exist"),
        (
            "malformed",
            '{"prompt": "hi"}\n{"prompt": "oops"\n',
            [],
            r"malformed\.jsonl:2: not valid JSON",
        ),
        (
            "no-prompt",
            '{"id": 1, "text": "hi"}\n',
            [],
            r"no-prompt\.jsonl:1: each row needs a string field 'prompt'",
        ),
        (
            "temperature",
            '{"prompt": "hi"}\n',
            ["--temperature", 5],
            r"temperature: .*less than or equal to 2",
        ),
        ("top-p", '{"prompt": "hi"}\n', ["--top-p", 0], r"top_p: .*greater than 0"),
        ("empty", "\n", [], r"empty\.jsonl: no prompts"),
        (
            "priority-type",
            '{"prompt": "hi", "priority": "1"}\n',
            ["--scheduling-policy", "priority"],
            r"priority-type\.jsonl:1: 'priority' must be an integer",
        ),
        (
            "max-model-len",
            '{"prompt": "hi"}\n',
            ["--max-model-len", 8],
            r"invalid setting: max_model_len: .*greater than or equal to 16",
        ),
        (
            "tp-drafter",
            '{"prompt": "hi"}\n',
            ["--tp", 3, "--drafter", "/nonexistent"],
            r"drafter '/nonexistent'",
        ),
    ],
)
def test_bad_input_exits_with_a_message(tmp_path, case, content, args, message):
    path = tmp_path / f"{case}.jsonl"
    if content is not None:
        path.write_text(content)
    proc = eagleserve("generate", path, "-o", tmp_path / "out.jsonl", *args, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr[-1000:]
    assert not (tmp_path / "out.jsonl").exists()


def test_bench_writes_table_and_json(tmp_path):
    """`eagleserve bench` on CPU through the Ray path: one row per (mode, siblings, overlap, batch),
    tokens from every engine (n-gram drafts among them), EAGLE-3 rows that accept drafts, a plot;
    no NVML figure without a GPU."""
    out = tmp_path / "bench.json"
    proc = eagleserve(
        "bench",
        "--device",
        "cpu",
        "--batch",
        "1,2",
        "-k",
        2,
        "--overlap",
        "both",
        "--num-prompts",
        2,
        "--output-len",
        8,
        "--max-model-len",
        512,
        "--logprobs",
        1,
        "--temperature",
        0.5,
        "--draft-siblings",
        "0,1",
        "--modes",
        "plain,eagle,ngram",
        "-o",
        out,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["mode"], r["siblings"], r["overlap"], r["batch"]) for r in runs) == [
        ("eagle", 0, False, 1),
        ("eagle", 0, False, 2),
        ("eagle", 0, True, 1),
        ("eagle", 0, True, 2),
        ("eagle", 1, False, 1),
        ("eagle", 1, False, 2),
        ("eagle", 1, True, 1),
        ("eagle", 1, True, 2),
        ("ngram", 0, False, 1),
        ("ngram", 0, False, 2),
        ("ngram", 0, True, 1),
        ("ngram", 0, True, 2),
        ("plain", 0, True, 1),
        ("plain", 0, True, 2),
    ]
    for r in runs:
        assert (
            r["output_tokens"] > 0
            and r["output_tokens_per_s"] > 0
            and r["nvml_busy_fraction"] is None
        )
        assert r["logprobs"] == 1 and r["temperature"] == 0.5
        assert (r["mean_acceptance_length"] > 1) == (r["mode"] == "eagle") or r["mode"] == "ngram"
    assert {r["k"] for r in runs if r["mode"] == "ngram"} == {2}
    assert "tok/s" in proc.stdout and out.with_suffix(".png").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--modes", "spec"], "--modes holds plain, eagle and/or ngram"),
        (["-k", "0"], "-k and --batch values must be >= 1"),
        (["--batch", "0,2"], "-k and --batch values must be >= 1"),
        (["--batch", "two"], "-k (or auto), --batch and --draft-siblings take integers"),
        (["--draft-siblings", "-1"], "--draft-siblings >= 0"),
    ],
)
def test_bench_refuses_bad_arguments(args, message):
    proc = eagleserve("bench", "--device", "cpu", *args, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and message in proc.stderr, (
        proc.stderr[-1000:]
    )


def test_gpu_utilization_is_the_busiest_gpus_mean(monkeypatch):
    """The NVML poller averages each GPU's utilization over the polls, reports the busiest GPU."""
    import types

    from deployments.gpu_utilization import GpuUtilization

    busy = {0: iter([10, 30] * 1000), 1: iter([50, 70] * 1000)}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(busy[h])),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuUtilization(interval_s=0.001) as utilization:
        while len(utilization.samples) < 10:
            time.sleep(0.001)
    n = len(utilization.samples)
    expected = sum(([50, 70] * n)[:n]) / n / 100  # GPU 1, over the polls taken
    assert utilization.busy_fraction == pytest.approx(expected)
    with GpuUtilization(enabled=False, interval_s=0.001) as utilization:  # a CPU run
        time.sleep(0.01)
    assert utilization.busy_fraction is None


def test_engine_leaves_no_socket_files(tmp_path, prompts_file):
    """A TP=2 engine run on one node (ipc channels) leaves no socket directory behind, and removes
    one that a crashed earlier run (a pid no longer alive) left. The run gets a temp dir of its
    own (short: Ray keeps its sockets there too), so other jobs do not count."""
    from tiny_models import tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="es-"))
    try:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
        ).stdout.strip()
        stale = tmp / f"eagleserve-{dead}-crashed"
        stale.mkdir()
        (stale / "plan-0").write_text("")
        model = tiny_llama(tmp_path / "tiny", layers=2)
        flags = ["--model", model, "--drafter", "none", "--tp", 2, "--device", "cpu"]
        out = tmp_path / "out.jsonl"
        proc = eagleserve(
            "generate", prompts_file, "-o", out, *flags, "--max-tokens", 4,
            "--max-model-len", 512, env=ENV | {"TMPDIR": str(tmp)},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len(out.read_text().splitlines()) == 4
        assert not [n for n in os.listdir(tmp) if n.startswith("eagleserve-")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_port_in_use_is_one_line(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = eagleserve("serve", "--port", port, "--device", "cpu", timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "pick another with --port or stop what holds it"
    ]


def test_version_and_help_tell_defaults():
    from importlib.metadata import version

    proc = eagleserve("--version", timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"eagleserve {version('eagleserve')}"
    serve_help = " ".join(eagleserve("serve", "--help", timeout=60).stdout.split())
    assert "--api-key" in serve_help and "--served-model-name" in serve_help
    assert "(default: 64, or the --config file's)" in serve_help  # --max-waiting-requests
    for command in ("generate", "bench", "loadtest", "serve"):
        text = eagleserve(command, "--help", timeout=60).stdout
        flags = re.findall(r"^  (-[-\w]+)", text, re.M)
        assert len(flags) > 5
        # each flag's entry (up to the next) has help text and names its default
        entries = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
        for entry in entries:
            if entry.startswith(("-h", "--version")):
                continue
            assert "default:" in " ".join(entry.split()), (command, entry)


def test_serve_flags_override_the_config_file(tmp_path):
    """serve's flags reach ServeConfig; a flag left unset keeps the --config file's value."""
    from deployments.cli_args import build_parser
    from deployments.cli_serve import _serve_config

    config = tmp_path / "serve.yaml"
    config.write_text("max_waiting_requests: 5\nport: 9001\nengine: {max_batch_size: 3}\n")
    parse = build_parser("eagleserve").parse_args
    cfg = _serve_config(parse(["serve", "--config", str(config)]))
    assert (cfg.max_waiting_requests, cfg.port, cfg.engine.max_batch_size) == (5, 9001, 3)
    assert cfg.api_key is None and cfg.model_name == "smollm2-135m"
    assert cfg.generation_config == "auto"
    args = ["--api-key", "k1", "--served-model-name", "mine", "--max-waiting-requests", "7"]
    args += ["--generation-config", "vllm"]
    engine = ["--max-batch-size", "4", "--kv-cache-memory-gb", "0.5", "--tool-call-parser", "json"]
    cfg = _serve_config(parse(["serve", "--config", str(config), *args, *engine]))
    assert (cfg.api_key, cfg.model_name, cfg.max_waiting_requests) == ("k1", "mine", 7)
    assert (cfg.port, cfg.engine.max_batch_size, cfg.engine.kv_cache_memory_gb) == (9001, 4, 0.5)
    assert cfg.tool_call_parser == "json" and cfg.chat_template is None
    assert cfg.generation_config == "vllm"


def test_prefix_caching_flag_reaches_every_command(tmp_path):
    """--no-enable-prefix-caching turns it off for generate, serve (over the file) and bench."""
    from deployments.cli import _engine_config
    from deployments.cli_args import build_parser
    from deployments.cli_serve import _serve_config

    parse = build_parser("eagleserve").parse_args
    generate = ["generate", "in.jsonl", "-o", "out.jsonl"]
    assert _engine_config(parse(generate)).enable_prefix_caching
    off = _engine_config(parse([*generate, "--no-enable-prefix-caching"]))
    assert not off.enable_prefix_caching
    config = tmp_path / "serve.yaml"
    config.write_text("engine: {enable_prefix_caching: false}\n")
    serve = ["serve", "--config", str(config)]
    assert not _serve_config(parse(serve)).engine.enable_prefix_caching
    assert _serve_config(parse([*serve, "--enable-prefix-caching"])).engine.enable_prefix_caching
    assert not parse(["bench", "--no-enable-prefix-caching"]).enable_prefix_caching


def test_scheduling_policy_flag_reaches_every_command(tmp_path):
    """--scheduling-policy for generate, serve (over the file) and bench; fcfs by default."""
    from deployments.cli import _engine_config
    from deployments.cli_args import build_parser
    from deployments.cli_serve import _serve_config

    parse = build_parser("eagleserve").parse_args
    generate = ["generate", "in.jsonl", "-o", "out.jsonl"]
    assert _engine_config(parse(generate)).scheduling_policy == "fcfs"
    policy = ["--scheduling-policy", "priority"]
    assert _engine_config(parse([*generate, *policy])).scheduling_policy == "priority"
    config = tmp_path / "serve.yaml"
    config.write_text("engine: {scheduling_policy: priority}\n")
    serve = ["serve", "--config", str(config)]
    assert _serve_config(parse(serve)).engine.scheduling_policy == "priority"
    fcfs = ["--scheduling-policy", "fcfs"]
    assert _serve_config(parse([*serve, *fcfs])).engine.scheduling_policy == "fcfs"
    assert parse(["bench", *policy]).scheduling_policy == "priority"
    assert parse(["bench"]).scheduling_policy == "fcfs"
