"""`eagleserve`: generate offline, serve over HTTP, train drafters, benchmark, load-test a server
(one function per subcommand; their parsers are in cli_args.py)."""

import json
import logging
import os
import socket
import sys
from pathlib import Path

from pydantic import ValidationError

from deployments.cli_args import ENGINE_FLAGS, build_parser


def _engine_config(args):
    from speculative.config import EngineConfig

    flags = {name: getattr(args, name) for name in ENGINE_FLAGS}
    return EngineConfig(**flags, overlap=not args.no_overlap)


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
    from speculative.request import RequestError
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
    from speculative.drafter_format import drafter_dir
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
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
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
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
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


COMMANDS = {
    "generate": cmd_generate,
    "train-drafter": cmd_train_drafter,
    "serve": cmd_serve,
    "bench": cmd_bench,
    "loadtest": cmd_loadtest,
}


def main(argv=None) -> None:
    args = build_parser(__doc__).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        COMMANDS[args.command](args)
    except ValidationError as e:
        where = ".".join(str(p) for p in e.errors()[0]["loc"]) or "engine config"
        raise SystemExit(f"error: invalid setting: {where}: {e.errors()[0]['msg']}") from None
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
