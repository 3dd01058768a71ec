"""`eagleserve bench` (offline throughput, deployments/bench.py) and `eagleserve loadtest` (HTTP
load on a running server, deployments/loadtest.py): their flags checked, the run, its table, JSON
and plot."""

import json
import os

from deployments.local_ray import local_cpus, local_ray_env


def cmd_bench(args) -> None:
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        local_ray_env()
    import ray

    from deployments import bench, bench_report

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
        num_cpus=None if args.device == "cuda" else local_cpus(1),
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
    bench_report.print_table(runs)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"model": args.model, "drafter": args.drafter, "runs": runs}, indent=1)
    )
    if bench_report.plot(runs, args.output.with_suffix(".png")):
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
