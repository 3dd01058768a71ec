"""The command line of `eagleserve bench` and `eagleserve loadtest` (cli_args.py builds the
whole parser): the sweep, the requests and the engine of a benchmark run, and the load test's
traffic. Every flag has a line of help and shows its default."""

import argparse
from pathlib import Path

from deployments.engine_flags import SCHEDULING_POLICY_HELP


def bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench", help="offline throughput: plain vs EAGLE-3, overlap, CUDA graphs, batch sizes"
    )
    b.add_argument("--model", default="smollm2-135m", help="model name, HF directory or .gguf")
    b.add_argument("--drafter", default="default", help="'default' or a drafter directory")
    b.add_argument(
        "--dataset", default=None, help="JSONL(.gz) of prompts (default: the shipped GSM8K test)"
    )
    b.add_argument(
        "--num-prompts", type=int, default=32, help="prompts per run (at least 2 x batch are used)"
    )
    _bench_sweep_args(b)
    _bench_request_args(b)
    _bench_engine_args(b)
    b.add_argument("-o", "--output", type=Path, default=Path("benchmarks/bench.json"), help="JSON")


def _bench_sweep_args(b: argparse.ArgumentParser) -> None:
    """What `eagleserve bench` runs every combination of."""
    b.add_argument("--batch", default="1,8", help="comma-separated concurrency levels")
    b.add_argument(
        "--modes",
        default="plain,eagle",
        help="plain, eagle and/or ngram (drafts looked up in the request, no drafter)",
    )
    b.add_argument("-k", default="5", help="comma-separated draft lengths (or auto)")
    b.add_argument("--cuda-graphs", choices=["on", "off", "both"], default="on", help="on GPUs")
    b.add_argument("--overlap", choices=["on", "off", "both"], default="on", help="the scheduler's")
    b.add_argument(
        "--graph-first-draft",
        action="store_true",
        help="capture each greedy decode step whole: verify + all draft forwards "
        "(default: first draft eager)",
    )
    b.add_argument(
        "--prompt-lookup",
        type=float,
        default=0.0,
        metavar="P",
        help="EAGLE-3 runs with prompt lookup below drafter probability P (0: off)",
    )
    b.add_argument(
        "--draft-siblings",
        default="0",
        metavar="M",
        help="comma-separated siblings per draft depth for the EAGLE-3 runs (0: a chain)",
    )


def _bench_request_args(b: argparse.ArgumentParser) -> None:
    """The sampling and output length of every request `eagleserve bench` sends."""
    b.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="of every request (0: greedy; sampled steps "
        "verify eagerly after the graphed target pass)",
    )
    b.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="every request asks for its tokens' "
        "log-probabilities and N top ones (what that costs: such steps verify eagerly)",
    )
    b.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    b.add_argument("--ignore-eos", action="store_true", help="every request makes --output-len")


def _bench_engine_args(b: argparse.ArgumentParser) -> None:
    """The device, context and KV cache of the engines `eagleserve bench` starts."""
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda")
    b.add_argument("--max-model-len", type=int, default=1024, help="the engines' context")
    b.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="tokens one step computes at most (verify tokens, then prefill chunks)",
    )
    b.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="GiB of KV cache blocks per rank (default: what --gpu-memory-utilization leaves)",
    )
    b.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU's memory each engine may use",
    )
    b.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engines reuse KV blocks of earlier requests' identical prefixes",
    )
    b.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help=SCHEDULING_POLICY_HELP + " (bench's requests all have priority 0)",
    )


def loadtest_parser(sub) -> None:
    lt = sub.add_parser(
        "loadtest",
        help="streaming HTTP load on a running server: a concurrency sweep or a "
        "Poisson arrival rate",
    )
    lt.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (loopback unless --allow-remote)"
    )
    lt.add_argument(
        "--allow-remote", action="store_true", help="allow a non-loopback --url (a real cluster)"
    )
    lt.add_argument("--model", default="smollm2-135m", help="the request's model field")
    lt.add_argument(
        "--api-key",
        default=None,
        help="sent as Authorization: Bearer (default: $EAGLESERVE_API_KEY)",
    )
    lt.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="API")
    lt.add_argument(
        "--dataset", default=None, help="JSONL(.gz) of prompts (default: the shipped GSM8K test)"
    )
    mode = lt.add_mutually_exclusive_group()
    mode.add_argument(
        "--concurrency", default="1,4,16", help="comma-separated requests in flight, one level each"
    )
    mode.add_argument(
        "--rate", default=None, help="comma-separated Poisson arrival rates (req/s) instead"
    )
    lt.add_argument("--num-requests", type=int, default=64, help="requests per level at most")
    lt.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds per level at most (then no new requests)",
    )
    lt.add_argument("--max-tokens", type=int, default=64, help="of every request")
    lt.add_argument("--temperature", type=float, default=0.0, help="of every request")
    lt.add_argument(
        "--ignore-eos", action="store_true", help="every request generates --max-tokens tokens"
    )
    lt.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    lt.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    lt.add_argument(
        "-o", "--output", type=Path, default=Path("benchmarks/loadtest.json"), help="JSON"
    )
