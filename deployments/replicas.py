"""Every LLM server replica's statistics, for /metrics and /health: a call through the Serve handle
reaches one replica, so each replica reports to a named registry actor (at start, after each
request, at each health check) and the ingress reads them all."""

import time

import ray

STALE_S = 10.0  # no report for this long (health checks come every 2 s): the replica is gone
SUMMED = (
    "num_slots",
    "num_running",
    "num_waiting",
    "num_steps",
    "num_rows",
    "num_extra_rows",
    "num_verify_rows",
    "draft_proposed",
    "draft_accepted",
)


@ray.remote(num_cpus=0)
class ReplicaRegistry:
    def __init__(self):
        self.reports = {}  # replica id -> (monotonic time, stats)

    def report(self, replica: str, stats: dict) -> None:
        self.reports[replica] = (time.monotonic(), stats)

    def forget(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def live(self) -> dict[str, dict]:
        """The stats of the replicas that reported in the last STALE_S seconds."""
        now = time.monotonic()
        self.reports = {r: (t, s) for r, (t, s) in self.reports.items() if now - t < STALE_S}
        return {r: s for r, (_, s) in self.reports.items()}


def registry(app_name: str):
    """The app's registry, created by whoever asks first; it outlives any one replica."""
    return ReplicaRegistry.options(
        name=f"eagleserve-replicas-{app_name}",
        namespace="eagleserve",
        get_if_exists=True,
        lifetime="detached",
    ).remote()


def summed(replicas: dict[str, dict]) -> dict:
    """One engine's stats from several: counts summed, acceptance by position summed, healthy if
    all are."""
    stats = list(replicas.values())
    total = {name: sum(s[name] for s in stats) for name in SUMMED}
    width = max(len(s["accepted_at"]) for s in stats)
    total["accepted_at"] = [
        sum(s["accepted_at"][i] for s in stats if i < len(s["accepted_at"])) for i in range(width)
    ]
    total["healthy"] = all(s["healthy"] for s in stats)
    total["scheduler"] = _summed_scheduler([s["scheduler"] for s in stats if "scheduler" in s])
    return total


def _summed_scheduler(metrics: list[dict]) -> dict:
    """The schedulers' metrics (vLLM's names): counts and totals summed, the KV cache usage
    (a fraction) averaged."""
    if not metrics:
        return {}
    total = {name: sum(m[name] for m in metrics) for name in metrics[0]}
    if "kv_cache_usage_perc" in total:
        total["kv_cache_usage_perc"] /= len(metrics)
    return total


def labelled_lines(replicas: dict[str, dict]) -> list[str]:
    """Per-replica gauges, labelled by replica id."""
    lines = ["# TYPE eagleserve_replicas gauge", f"eagleserve_replicas {len(replicas)}"]
    for name, key in (
        ("replica_healthy", "healthy"),
        ("replica_batch_size", "num_running"),
        ("replica_queue_depth", "num_waiting"),
        ("replica_engine_steps_total", "num_steps"),
    ):
        lines.append(f"# TYPE eagleserve_{name} gauge")
        for replica, s in sorted(replicas.items()):
            lines.append(f'eagleserve_{name}{{replica="{replica}"}} {int(s[key])}')
    return lines
