"""The `eagleserve` command line: one parser builder per subcommand (the engine flags generate and
serve share are in engine_flags.py). Every flag has a line of help and shows its default."""

import argparse
import functools
from pathlib import Path

from deployments.engine_flags import SCHEDULING_POLICY_HELP, engine_args


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, except where its help already says it."""

    def _get_help_string(self, action):
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate for every row of a JSONL file")
    gen.add_argument("input", type=Path, help='JSONL rows {"id", "prompt"}')
    gen.add_argument("-o", "--output", type=Path, required=True, help="JSONL results")
    engine_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: off)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (None: random)")
    gen.add_argument("--max-tokens", type=int, default=256, help="output tokens per row at most")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")


def _train_parser(sub) -> None:
    train = sub.add_parser(
        "train-drafter",
        help="self-distill data and train an EAGLE-3 drafter",
        formatter_class=argparse.HelpFormatter,  # unset flags keep --config's or TrainConfig's
    )
    opt = train.add_argument  # every flag overrides --config; unset, the config's value holds
    opt("--config", type=Path, help="JSON with TrainConfig fields (flags override it)")
    opt("--model", help="target: model name, HF directory or .gguf file")
    opt("-o", "--output", help="directory of the exported drafter")
    opt(
        "--data",
        help="directory of self-distilled data (generated when empty; default: OUTPUT.data)",
    )
    opt(
        "--distill-only",
        "--data-only",
        dest="distill_only",
        action="store_true",
        help="distil one more part of data, continuing the prompt order (with --synthesize: "
        "continue the corpus), and stop",
    )
    opt(
        "--synthesize",
        type=int,
        metavar="N",
        help="no dataset: the target writes N conversations itself, user turns too, "
        "then trains on them (a rerun continues the corpus)",
    )
    opt("--synthesize-time-limit", type=float, help="seconds of synthesis; then stop (resumable)")
    opt("--kinds", nargs="+", help="kinds of request to synthesize (default: all)")
    opt("--eval-prompts", nargs="+", help="JSONL(.gz) prompts of the acceptance printed at the end")
    opt("--prompts", nargs="+", help="JSONL(.gz) prompt files for self-distillation")
    opt("--num-prompts", type=int, help="prompts to self-distil")
    opt("--max-steps", type=int, help="training steps at most")
    opt("--draft-vocab-size", type=int, help="tokens the drafter can propose")
    opt("--ttt-steps", type=int, help="unrolled draft steps")
    opt("--lr", type=float, help="peak learning rate")
    opt("--epochs", type=float, help="passes over the data (sets the steps; over --max-steps)")
    opt("--checkpoint-every", type=int, help="steps between checkpoints")
    opt(
        "--init-from",
        help="drafter directory to start from (its weights, and its head rows "
        "for the tokens the new draft vocabulary holds)",
    )
    opt("--time-limit", type=float, help="seconds of training; then checkpoint and stop")
    opt("--distill-time-limit", type=float, help="seconds of self-distillation (admitting prompts)")
    opt(
        "--distill-skip",
        type=int,
        help="prompts at the start of the order not to distil (those "
        "an earlier dataset, no longer here, covered)",
    )
    opt("--distill-workers", type=int, help="engine processes sharing the device to self-distil")
    opt("--device", choices=["auto", "cpu", "cuda"], help="where to train")


def _serve_parser(sub) -> None:
    from deployments.config import ServeConfig

    def add(flag, field=None, **kw):  # None: the --config file's value, else ServeConfig's
        default = ServeConfig.model_fields[field or flag[2:].replace("-", "_")].default
        kw["help"] += f" (default: {kw.pop('shown', default)}, or the --config file's)"
        srv.add_argument(flag, default=None, **kw)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API with Ray Serve")
    srv.add_argument("--config", type=Path, help="YAML file with the ServeConfig fields")
    add("--host", help="HTTP address; 0.0.0.0 serves every interface (set --api-key then)")
    add("--port", type=int, help="HTTP port")
    add(
        "--api-key",
        help="clients must send Authorization: Bearer KEY",
        shown="$EAGLESERVE_API_KEY, else no key",
    )
    add("--served-model-name", help="the model name clients send and see", shown="--model")
    add("--max-waiting-requests", type=int, help="queued requests per replica; beyond, 429")
    add("--replicas", "num_replicas", type=int, help="engine replicas")
    add("--chat-template", help="a Jinja chat template file replacing the model's")
    add(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "json"],
        help="how tool calls are read from the output",
        shown="chosen from the chat template",
    )
    add("--reasoning-parser", choices=["think"], help="<think> text becomes `reasoning`")
    add(
        "--generation-config",
        help="the sampling defaults of unset request fields: auto (the model's "
        "generation_config.json), vllm (none) or a directory holding one",
    )
    srv.add_argument(
        "--address",
        default=None,
        help="join this Ray cluster (default: $RAY_ADDRESS, else a new Ray on loopback only)",
    )
    engine_args(srv, serve=True)


def _bench_parser(sub) -> None:
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
    b.add_argument("--modes", default="plain,eagle", help="plain and/or eagle")
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


def _loadtest_parser(sub) -> None:
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


def build_parser(description: str) -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("eagleserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        release = "unknown"
    parser = argparse.ArgumentParser(prog="eagleserve", description=description)
    parser.add_argument("--version", action="version", version=f"eagleserve {release}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=HelpFormatter)
    for add_parser in (
        _generate_parser,
        _train_parser,
        _serve_parser,
        _bench_parser,
        _loadtest_parser,
    ):
        add_parser(sub)
    return parser
