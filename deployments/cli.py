"""`eagleserve`: generate offline, serve over HTTP, train drafters, benchmark, load-test a server
(one function per subcommand, one parser builder each)."""

import argparse
import functools
import json
import logging
import os
import socket
import sys
from pathlib import Path

from pydantic import ValidationError

ENGINE_FLAGS = (
    "model",
    "drafter",
    "num_draft_tokens",
    "max_batch_size",
    "max_model_len",
    "device",
    "dtype",
    "tp",
    "prompt_lookup",
    "draft_siblings",
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default, except where its help already says it."""

    def _get_help_string(self, action):
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _engine_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """Engine flags with EngineConfig's defaults. For serve they default to None, so that a flag
    left unset keeps the --config file's value."""
    from speculative.config import EngineConfig

    def add(*names, **kw):
        field = names[0].lstrip("-").replace("-", "_")
        default = EngineConfig.model_fields[field].default
        if serve:
            kw["help"] += f" (default: {default}, or the --config file's)"
        p.add_argument(*names, default=None if serve else default, **kw)

    add("--model", help="model name, HF directory or .gguf file")
    add("--drafter", help="'default', 'none' or an EAGLE-3 drafter directory")
    add("--num-draft-tokens", "-k", type=int, help="draft tokens per step (K)")
    add("--max-batch-size", type=int, help="requests decoded together at most")
    add("--max-model-len", type=int, help="prompt + output tokens per request at most")
    add("--device", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    add("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weights' dtype")
    add("--tp", type=int, help="tensor-parallel size (runs on Ray when > 1)")
    p.add_argument(
        "--no-overlap", action="store_true", help="process each step's results before the next"
    )
    add(
        "--prompt-lookup",
        type=float,
        metavar="P",
        help="draft the token that followed the last five tokens earlier in the request where "
        "the drafter's own draft has probability below P (0: off)",
    )
    add(
        "--draft-siblings",
        type=int,
        metavar="M",
        help="verify the drafter's next M choices at every draft depth too, in the same pass "
        "(0: a chain)",
    )


def _engine_config(args):
    from speculative.config import EngineConfig

    return EngineConfig(
        model=args.model,
        drafter=args.drafter,
        num_draft_tokens=args.num_draft_tokens,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        tp=args.tp,
        overlap=not args.no_overlap,
        prompt_lookup=args.prompt_lookup,
        draft_siblings=args.draft_siblings,
    )


def _read_jsonl(path: Path) -> list[dict]:
    from speculative.jsonl import read_rows

    rows = []
    try:
        for where, row in read_rows(path):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise SystemExit(f"error: {where}: each row needs a string field 'prompt'")
            rows.append(row)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return rows


def cmd_generate(args) -> None:
    from speculative.config import SamplingParams
    from speculative.engine import encode_prompt
    from speculative.scheduler import RequestError
    from workers.loader import load_tokenizer, resolve_model

    if not args.input.is_file():
        raise SystemExit(f"error: input file {args.input} does not exist")
    rows = _read_jsonl(args.input)
    if not rows:
        raise SystemExit(f"error: {args.input}: no prompts")
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    cfg = _engine_config(args)
    tokenizer = load_tokenizer(resolve_model(cfg.model))
    prompts = [encode_prompt(tokenizer, row["prompt"], args.raw) for row in rows]
    try:
        results = run_to_completion(cfg, prompts, params)
    except RequestError as e:
        raise SystemExit(f"error: {e}") from None
    with open(args.output, "w") as f:
        for i, (row, r) in enumerate(zip(rows, results)):
            f.write(
                json.dumps(
                    {
                        "id": row.get("id", i),
                        "text": tokenizer.decode(r["token_ids"], skip_special_tokens=True),
                        "token_ids": r["token_ids"],
                        "num_tokens": len(r["token_ids"]),
                        "acceptance_length": round(r["acceptance_length"], 4),
                        "finish_reason": r["finish_reason"],
                    }
                )
                + "\n"
            )
    mean = sum(r["acceptance_length"] for r in results) / max(len(results), 1)
    print(
        f"wrote {len(results)} rows to {args.output} (mean acceptance length {mean:.2f})",
        file=sys.stderr,
    )


def run_to_completion(cfg, prompts: list[list[int]], params) -> list[dict]:
    """TP=1: the single-process engine. TP>1: worker actors on a local Ray (or RAY_ADDRESS) driven
    by the coordinator actor."""
    if cfg.tp == 1:
        from speculative.engine import LLMEngine

        requests = LLMEngine(cfg).generate(prompts, params)
        return [
            {
                "token_ids": r.output_ids,
                "finish_reason": r.finish_reason,
                "acceptance_length": r.acceptance_length,
            }
            for r in requests
        ]
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        _local_ray_env()
    import ray

    from speculative.coordinator import CoordinatorActor
    from speculative.drafter import drafter_dir
    from speculative.executor import check_tp_size

    check_tp_size(cfg)  # what fails here would fail in every worker, with Ray's tracebacks
    if cfg.drafter not in ("none", "default"):
        drafter_dir(cfg.drafter)
    num_cpus = None if address or cfg.device == "cuda" else _local_cpus(cfg.tp)
    ray.init(
        address=address,
        num_cpus=num_cpus,
        include_dashboard=None if address else False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        coordinator = CoordinatorActor.remote(cfg)
        try:
            return ray.get(coordinator.generate.remote(prompts, params))
        except ray.exceptions.RayTaskError as e:
            raise (
                e.cause or e
            ) from None  # the error itself (a bad request, say), not Ray's traceback
        finally:
            ray.get(coordinator.shutdown.remote())
    finally:
        ray.shutdown()


def cmd_train_drafter(args) -> None:
    from speculative.train.config import TrainConfig
    from speculative.train.pipeline import train_drafter

    fields = {}
    if args.config:
        try:
            fields = json.loads(args.config.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config {args.config} is not valid JSON: {e}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("distill", {}), dict):
            raise ValueError(
                f"config {args.config} must be a JSON object of TrainConfig fields "
                "(distill: an object)"
            )
    fields.update(
        {
            k: v
            for k, v in {
                "model": args.model,
                "output": args.output,
                "data": args.data,
                "max_steps": args.max_steps,
                "draft_vocab_size": args.draft_vocab_size,
                "ttt_steps": args.ttt_steps,
                "time_limit_s": args.time_limit,
                "init_from": args.init_from,
                "device": args.device,
            }.items()
            if v is not None
        }
    )
    distill = {
        k: v
        for k, v in {
            "prompt_files": args.prompts,
            "num_prompts": args.num_prompts,
            "time_limit_s": args.distill_time_limit,
            "skip_prompts": args.distill_skip,
            "num_workers": args.distill_workers,
        }.items()
        if v is not None
    }
    if distill:
        fields["distill"] = {**fields.get("distill", {}), **distill}
    summary = train_drafter(TrainConfig(**fields), distill_only=args.distill_only)
    print(json.dumps(summary), file=sys.stderr)


def _local_cpus(tp: int) -> int:
    # a local CPU run may place more ranks than cores: ranks take one logical CPU each
    return max(os.cpu_count() or 1, tp + 1)


def _local_ray_env() -> None:
    """A Ray started here listens on loopback only (Ray binds every interface unless told that
    this host runs no cluster), with Ray's token authentication. Call before importing ray."""
    if "ray" in sys.modules:  # too late: Ray read these at import, and half a change breaks auth
        logging.getLogger(__name__).warning("ray was imported first: local Ray keeps its defaults")
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")


def _check_port_free(host: str, port: int) -> None:
    """One line naming the port, not Serve's proxy failing with a traceback a minute later."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's proxy does
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SystemExit(
                f"error: cannot listen on {host}:{port} ({e.strerror}); "
                "pick another with --port or stop what holds it"
            ) from None


def _serve_config(args):
    from deployments.config import load_config

    overrides = {f"engine.{k}": getattr(args, k) for k in ENGINE_FLAGS}
    if args.no_overlap:
        overrides["engine.overlap"] = False
    cfg = load_config(
        args.config,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        ray_address=args.address,
        num_replicas=args.replicas,
        **overrides,
    )
    return cfg


def cmd_serve(args) -> None:
    import signal
    import threading

    cfg = _serve_config(args)
    local = cfg.ray_address is None and not os.environ.get("RAY_ADDRESS")
    if local:
        _check_port_free(cfg.host, cfg.port)
        _local_ray_env()  # before anything imports ray
    import ray
    from ray import serve

    from deployments.server import build_app
    from speculative.executor import check_tp_size

    check_tp_size(cfg.engine)

    ray.init(
        address=cfg.ray_address,
        num_cpus=_local_cpus(cfg.engine.tp * cfg.num_replicas) if local else None,
        include_dashboard=False if local else None,
        logging_level="WARNING",
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if not args.verbose:  # the driver's Serve lines; we print our own (replicas' logs still show)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(build_app(cfg), name="eagleserve", route_prefix="/")
        url = f"http://{cfg.host}:{cfg.port}/v1"
        print(f"eagleserve: serving {cfg.model_name!r} at {url} (Ctrl-C stops)", flush=True)
        stop.wait()
        print("eagleserve: shutting down", flush=True)
    finally:
        # delete, not serve.shutdown(): the replicas stop gracefully either way, but shutdown()
        # kills the controller while its own graceful_shutdown runs, and Ray logs that as a failure
        serve.delete("eagleserve")
        if local:
            ray.shutdown()


def cmd_bench(args) -> None:
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        _local_ray_env()
    import ray

    from deployments import bench

    on = {"on": [True], "off": [False], "both": [True, False]}
    try:
        ks, batches = [int(k) for k in args.k.split(",")], [int(b) for b in args.batch.split(",")]
        siblings = [int(m) for m in args.draft_siblings.split(",")]
    except ValueError:
        raise ValueError(
            "-k, --batch and --draft-siblings take integers, comma-separated"
        ) from None
    modes = args.modes.split(",")
    if min(ks) < 1 or min(batches) < 1 or min(siblings) < 0 or not set(modes) <= {"plain", "eagle"}:
        raise ValueError(
            "-k and --batch values must be >= 1, --draft-siblings >= 0, and --modes holds plain "
            "and/or eagle"
        )
    prompts = bench.load_prompts(args.dataset, max(args.num_prompts, 1))
    ray.init(
        address=address,
        num_cpus=None if args.device == "cuda" else _local_cpus(1),
        include_dashboard=None if address else False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        runs = bench.bench(
            args.model,
            args.drafter,
            ks,
            modes,
            on[args.cuda_graphs],
            on[args.overlap],
            batches,
            prompts,
            args.output_len,
            args.ignore_eos,
            args.device,
            args.max_model_len,
            args.num_prompts,
            graph_first_draft=args.graph_first_draft,
            prompt_lookup=args.prompt_lookup,
            logprobs=args.logprobs,
            siblings=siblings,
            temperature=args.temperature,
        )
    finally:
        ray.shutdown()
    bench.print_table(runs)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"model": args.model, "drafter": args.drafter, "runs": runs}, indent=1)
    )
    if bench.plot(runs, args.output.with_suffix(".png")):
        print(f"plot: {args.output.with_suffix('.png')}")
    print(f"results: {args.output}")


def cmd_loadtest(args) -> None:
    from deployments import bench, loadtest

    url = loadtest.check_url(args.url, args.allow_remote)
    if args.num_requests < 1 or args.duration <= 0 or args.timeout <= 0 or args.max_tokens < 1:
        raise ValueError(
            "--num-requests and --max-tokens must be >= 1, --duration and --timeout > 0"
        )
    try:
        concurrency = [int(c) for c in args.concurrency.split(",")] if args.rate is None else None
        rate = [float(r) for r in args.rate.split(",")] if args.rate is not None else None
    except ValueError:
        raise ValueError(
            "--concurrency takes integers and --rate numbers, comma-separated"
        ) from None
    if any(v <= 0 for v in concurrency or rate):
        raise ValueError("--concurrency and --rate values must be positive")
    prompts = bench.load_prompts(args.dataset, args.num_requests)
    runs = loadtest.loadtest(
        url,
        prompts,
        concurrency=concurrency,
        rate=rate,
        num_requests=args.num_requests,
        duration_s=args.duration,
        model=args.model,
        endpoint=args.endpoint,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
        api_key=args.api_key or os.environ.get("EAGLESERVE_API_KEY"),
        seed=args.seed,
    )
    loadtest.print_table(runs)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "url": url,
                "model": args.model,
                "endpoint": args.endpoint,
                "max_tokens": args.max_tokens,
                "runs": runs,
            },
            indent=1,
        )
    )
    if loadtest.plot(runs, args.output.with_suffix(".png")):
        print(f"plot: {args.output.with_suffix('.png')}")
    print(f"results: {args.output}")
    if not any(r["num_ok"] for r in runs):
        errors = sorted({kind for r in runs for kind in r["errors"]})
        raise SystemExit(f"error: no request succeeded (errors: {', '.join(errors)})")


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate for every row of a JSONL file")
    gen.add_argument("input", type=Path, help='JSONL rows {"id", "prompt"}')
    gen.add_argument("-o", "--output", type=Path, required=True, help="JSONL results")
    _engine_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: off)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (None: random)")
    gen.add_argument("--max-tokens", type=int, default=256, help="output tokens per row at most")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=cmd_generate)


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
        action="store_true",
        help="distil one more part of data, continuing the prompt order, and stop",
    )
    opt("--prompts", nargs="+", help="JSONL(.gz) prompt files for self-distillation")
    opt("--num-prompts", type=int, help="prompts to self-distil")
    opt("--max-steps", type=int, help="training steps at most")
    opt("--draft-vocab-size", type=int, help="tokens the drafter can propose")
    opt("--ttt-steps", type=int, help="unrolled draft steps")
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
    train.set_defaults(func=cmd_train_drafter)


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
    srv.add_argument(
        "--address",
        default=None,
        help="join this Ray cluster (default: $RAY_ADDRESS, else a new Ray on loopback only)",
    )
    _engine_args(srv, serve=True)
    srv.set_defaults(func=cmd_serve)


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
    b.add_argument("--batch", default="1,8", help="comma-separated concurrency levels")
    b.add_argument("--modes", default="plain,eagle", help="plain and/or eagle")
    b.add_argument("-k", default="5", help="comma-separated draft lengths")
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
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda")
    b.add_argument("--max-model-len", type=int, default=1024, help="the engines' context")
    b.add_argument("-o", "--output", type=Path, default=Path("benchmarks/bench.json"), help="JSON")
    b.set_defaults(func=cmd_bench)


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
    lt.set_defaults(func=cmd_loadtest)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("eagleserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        release = "unknown"
    parser = argparse.ArgumentParser(prog="eagleserve", description=__doc__)
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


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.func(args)
    except ValidationError as e:
        where = ".".join(str(p) for p in e.errors()[0]["loc"]) or "engine config"
        raise SystemExit(f"error: invalid setting: {where}: {e.errors()[0]['msg']}") from None
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
