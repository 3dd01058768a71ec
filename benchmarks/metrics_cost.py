"""prometheus_client or ray.util.metrics for /metrics: the cost of one observation on the
request path, of a replica's report (snapshot + pickle) and of a scrape of R replicas; and
where ray.util.metrics' series show up (Ray's metrics agent on the node's port, after how long,
under which name). Prints a table, writes JSON."""

import argparse
import bisect
import json
import pickle
import time
import warnings

import httpx
import ray
from prometheus_client import CollectorRegistry, Counter, Histogram

from deployments.metrics import IngressMetrics, exposition
from deployments.replica_metrics import TTFT_BUCKETS, ReplicaMetrics

LABELS = {"model_name": "m", "engine": "0", "replica": "r"}
STATS = {  # Coordinator.stats() of a speculating engine, K=5
    "num_steps": 1000, "num_extra_rows": 10, "num_verify_rows": 900, "draft_proposed": 4500,
    "draft_accepted": 2000, "accepted_at": [800, 600, 350, 180, 70], "healthy": True,
    "scheduler": {"num_requests_running": 8, "num_requests_waiting": 2,
                  "kv_cache_usage_perc": 0.4, "prefix_cache_queries_total": 9000,
                  "prefix_cache_hits_total": 3000, "num_preemptions_total": 0},
}  # fmt: skip


def per_call_us(fn, n: int) -> float:
    for _ in range(min(n, 100)):  # untimed: first calls build what later ones reuse
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - start) / n


def hand_written_observe():
    """The bisect histogram the hand-written exposition had."""
    counts, total = [0] * (len(TTFT_BUCKETS) + 1), [0.0, 0]

    def observe():
        counts[bisect.bisect_left(TTFT_BUCKETS, 0.05)] += 1
        total[0] += 0.05
        total[1] += 1

    return observe


def prometheus_client_observe():
    registry = CollectorRegistry(auto_describe=False)
    h = Histogram("x_seconds", "x", list(LABELS), buckets=TTFT_BUCKETS, registry=registry)
    child = h.labels(**LABELS)
    return lambda: child.observe(0.05)


def prometheus_client_inc():
    c = Counter("x", "x", list(LABELS), registry=CollectorRegistry(auto_describe=False))
    child = c.labels(**LABELS)
    return lambda: child.inc(3)


def ray_metrics():
    from ray.util.metrics import Counter as RayCounter
    from ray.util.metrics import Histogram as RayHistogram

    h = RayHistogram("eaglebench_ttft_seconds", "x", list(TTFT_BUCKETS), tag_keys=tuple(LABELS))
    c = RayCounter("eaglebench_generation_tokens", "x", tag_keys=tuple(LABELS))
    return (lambda: h.observe(0.05, tags=LABELS)), (lambda: c.inc(3, tags=LABELS))


def request_us(n: int, outputs: int) -> float:
    """A whole request on the replica: start, `outputs` outputs, finish."""
    metrics = ReplicaMetrics("m", "r", 8192)

    def one():
        timer = metrics.start_request(100)
        for i in range(outputs):
            timer.output(3, "stop" if i == outputs - 1 else None)

    return per_call_us(one, n)


def scrape_rows(replica_counts: list[int], n: int) -> list[dict]:
    metrics = ReplicaMetrics("m", "r", 8192)
    snapshot = metrics.snapshot(STATS)
    rows = [
        {
            "what": "replica report: snapshot + pickle",
            "us": per_call_us(lambda: pickle.dumps(metrics.snapshot(STATS)), n),
            "bytes": len(pickle.dumps(snapshot)),
        }
    ]
    ingress = IngressMetrics()
    for r in replica_counts:
        replicas = {f"r{i}": {"metrics": snapshot} for i in range(r)}
        body = exposition(ingress, "m", replicas)
        us = per_call_us(lambda replicas=replicas: exposition(ingress, "m", replicas), n // 10)
        rows.append({"what": f"scrape of {r} replicas", "us": us, "bytes": len(body)})
    return rows


def _probe_series(text: str) -> list[str]:
    lines = text.splitlines()
    return sorted({ln.split("{")[0] for ln in lines if "probe" in ln and not ln.startswith("#")})


def ray_export_probe(timeout_s: float) -> dict:
    """Where ray.util.metrics' series appear: the node's metrics port, not our /metrics."""
    from ray.util.metrics import Counter as RayCounter

    port = ray.get_runtime_context().worker.node.metrics_export_port
    plain = RayCounter("eaglebench_probe_tokens", "x", tag_keys=("model_name",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        colon = RayCounter("vllm:eaglebench_probe_tokens", "x", tag_keys=("model_name",))
    plain.inc(1, tags={"model_name": "m"})
    colon.inc(1, tags={"model_name": "m"})
    start, names = time.monotonic(), []
    while time.monotonic() - start < timeout_s and not names:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        names = _probe_series(text)
        time.sleep(0.5)
    seen_s = time.monotonic() - start
    time.sleep(5)  # the colon name gets as long again
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        "seconds_until_exported": round(seen_s, 1) if names else None,
        "exported_names": _probe_series(text),
        "colon_name_warning": str(caught[0].message) if caught else None,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=20000)
    p.add_argument("--replicas", default="1,2,8")
    p.add_argument("-o", "--output", default="benchmarks/metrics_cost.json")
    args = p.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        ray_observe, ray_inc = ray_metrics()
        timed = {
            "histogram observe, hand-written": hand_written_observe(),
            "histogram observe, prometheus_client": prometheus_client_observe(),
            "histogram observe, ray.util.metrics": ray_observe,
            "counter inc, prometheus_client": prometheus_client_inc(),
            "counter inc, ray.util.metrics": ray_inc,
        }
        rows = [{"what": what, "us": per_call_us(fn, args.n)} for what, fn in timed.items()]
        rows.append({"what": "request of 32 outputs", "us": request_us(args.n // 20, 32)})
        rows += scrape_rows([int(r) for r in args.replicas.split(",")], args.n // 10)
        probe = ray_export_probe(timeout_s=60)
    finally:
        ray.shutdown()
    base = rows[1]["us"]
    for row in rows:
        row["vs_prometheus_client_observe"] = round(row["us"] / base, 2)
        row["us"] = round(row["us"], 3)
    print(f"{'what':42} {'us':>10} {'x pc observe':>13} {'bytes':>8}")
    for row in rows:
        print(
            f"{row['what']:42} {row['us']:>10} {row['vs_prometheus_client_observe']:>13} "
            f"{row.get('bytes', ''):>8}"
        )
    print("each call timed after up to 100 untimed calls of it")
    print(json.dumps(probe, indent=2))
    with open(args.output, "w") as f:
        json.dump({"rows": rows, "ray_util_metrics_export": probe}, f, indent=2)


if __name__ == "__main__":
    main()
