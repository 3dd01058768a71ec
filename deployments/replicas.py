"""Every LLM server replica's statistics, for /metrics and /health: a call through the Serve handle
reaches one replica, so each replica reports to a named registry actor (at start, after each
request, at each health check) and the ingress reads them all."""

import time

import ray

STALE_S = 10.0  # no report for this long (health checks come every 2 s): the replica is gone


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
