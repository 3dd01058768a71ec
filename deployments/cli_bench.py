"""`eagleserve bench` (offline throughput, deployments/bench.py) and `eagleserve loadtest` (HTTP
load on a running server, deployments/loadtest.py): their flags checked, the run, its table, JSON
and plot."""

import json
import os
from pathlib import Path

from deployments.local_ray import local_cpus, local_ray_env
from deployments.prompt_sets import load_prompts


def _bench_sweep(args) -> tuple[list[int], list[int], list[int], list[str]]:
    """-k, --batch, --draft-siblings and --modes as lists, checked."""
    try:
        ks = [k if k == "auto" else int(k) for k in args.k.split(",")]
        batches = [int(b) for b in args.batch.split(",")]
        siblings = [int(m) for m in args.draft_siblings.split(",")]
    except ValueError:
        raise ValueError(
            "-k (or auto), --batch and --draft-siblings take integers, comma-separated"
        ) from None
    modes = args.modes.split(",")
    if (
        min(k for k in ks + [1] if k != "auto") < 1
        or min(batches) < 1
        or min(siblings) < 0
        or not set(modes) <= {"plain", "eagle", "ngram"}
    ):
        raise ValueError(
            "-k and --batch values must be >= 1, --draft-siblings >= 0, and --modes holds plain, "
            "eagle and/or ngram"
        )
    return ks, batches, siblings, modes


def _run_bench(args, prompts: list[str], ks, batches, siblings, modes) -> list[dict]:
    """bench.bench over the sweep, with the rest of its settings from the flags."""
    from deployments import bench

    on = {"on": [True], "off": [False], "both": [True, False]}
    return bench.bench(
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
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
    )


def _write_report(output: Path, report: dict, plot) -> None:
    """The report as JSON at `output`, and plot(report's runs) next to it as a PNG."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    if plot(report["runs"], output.with_suffix(".png")):
        print(f"plot: {output.with_suffix('.png')}")
    print(f"results: {output}")


def cmd_bench(args) -> None:
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        local_ray_env()
    import ray

    from deployments import bench_report

    ks, batches, siblings, modes = _bench_sweep(args)
    prompts = load_prompts(args.dataset, max(args.num_prompts, 1))
    ray.init(
        address=address,
        num_cpus=None if args.device == "cuda" else local_cpus(1),
        include_dashboard=None if address else False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        runs = _run_bench(args, prompts, ks, batches, siblings, modes)
    finally:
        ray.shutdown()
    bench_report.print_table(runs)
    _write_report(
        args.output, {"model": args.model, "drafter": args.drafter, "runs": runs}, bench_report.plot
    )


def _loadtest_levels(args) -> tuple[list[int] | None, list[float] | None]:
    """--concurrency's levels, or --rate's when given, checked."""
    try:
        concurrency = [int(c) for c in args.concurrency.split(",")] if args.rate is None else None
        rate = [float(r) for r in args.rate.split(",")] if args.rate is not None else None
    except ValueError:
        raise ValueError(
            "--concurrency takes integers and --rate numbers, comma-separated"
        ) from None
    if any(v <= 0 for v in concurrency or rate):
        raise ValueError("--concurrency and --rate values must be positive")
    return concurrency, rate


def cmd_loadtest(args) -> None:
    from deployments import loadtest

    url = loadtest.check_url(args.url, args.allow_remote)
    if args.num_requests < 1 or args.duration <= 0 or args.timeout <= 0 or args.max_tokens < 1:
        raise ValueError(
            "--num-requests and --max-tokens must be >= 1, --duration and --timeout > 0"
        )
    concurrency, rate = _loadtest_levels(args)
    prompts = load_prompts(args.dataset, args.num_requests)
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
    report = {
        "url": url,
        "model": args.model,
        "endpoint": args.endpoint,
        "max_tokens": args.max_tokens,
        "runs": runs,
    }
    _write_report(args.output, report, loadtest.plot)
    if not any(r["num_ok"] for r in runs):
        errors = sorted({kind for r in runs for kind in r["errors"]})
        raise SystemExit(f"error: no request succeeded (errors: {', '.join(errors)})")
