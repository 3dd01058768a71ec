"""The `eagleserve` command line: one parser builder per subcommand (the engine flags generate and
serve share are in engine_flags.py). Every flag has a line of help and shows its default."""

import argparse
import functools
from pathlib import Path

from deployments.cli_bench_args import bench_parser, loadtest_parser
from deployments.engine_flags import engine_args


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


def corpus_arg(text: str) -> dict:
    """DIR or DIR=WEIGHT -> a TrainConfig.corpora entry."""
    path, _, weight = text.partition("=")
    try:
        return {"data": path, "weight": float(weight) if weight else 1.0}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the weight after '=' must be a number"
        ) from None


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
    opt(
        "--corpus",
        nargs="+",
        type=corpus_arg,
        dest="corpora",
        metavar="DIR[=WEIGHT]",
        help="train on these data directories together, each epoch drawing WEIGHT times each "
        "one's sequences (default 1; 0.5: a random half)",
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
    opt("--steps-this-run", type=int, help="training steps of this run (a slice); then stop")
    opt(
        "--handover",
        help="directory a slice continues from (when there is no checkpoint) and writes its "
        "checkpoint to, in files under the export shard size",
    )
    opt("--handover-dtype", choices=["float32", "bfloat16"], help="of the hand-over's weights")
    opt(
        "--handover-optimizer",
        action=argparse.BooleanOptionalAction,
        help="AdamW's moments in the hand-over too (continues exactly; twice the weights' bytes)",
    )
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
        bench_parser,
        loadtest_parser,
    ):
        add_parser(sub)
    return parser
