"""/metrics: every replica's series (deployments/replica_metrics.py, a `replica` label apart) in
one Prometheus exposition, built at scrape time from the replicas' last reports, with the
ingress's own counters."""

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from deployments.replica_metrics import plain

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the classic text format


class IngressMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self.http_requests = Counter(
            "eagleserve_http_requests",
            "Requests to the completion endpoints, by endpoint and HTTP status (refusals too).",
            ("endpoint", "status"),
            registry=self.registry,
        )

    def count(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()


class _Families:
    """What prometheus_client's encoder reads: an object whose collect() gives the families."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def merged(snapshots: list[list[tuple]]) -> list[Metric]:
    """One family per name, holding every replica's samples (told apart by their labels)."""
    families: dict[str, Metric] = {}
    for snapshot in snapshots:
        for name, documentation, kind, samples in snapshot:
            family = families.setdefault(name, Metric(name, documentation, kind))
            for sample_name, labels, value in samples:
                family.add_sample(sample_name, labels, value)
    return list(families.values())


def exposition(ingress: IngressMetrics, model_name: str, replicas: dict[str, dict]) -> bytes:
    """The scrape's body, in the text format. Not OpenMetrics, even when asked: prometheus_client's
    encoder for it turns the colons of vLLM's names into underscores on the sample lines."""
    count = GaugeMetricFamily(
        "eagleserve_replicas", "LLM server replicas reporting.", labels=["model_name"]
    )
    count.add_metric([model_name], len(replicas))
    snapshots = [replicas[r]["metrics"] for r in sorted(replicas)]
    snapshots += [plain(ingress.registry.collect()), plain([count])]
    return generate_latest(_Families(merged(snapshots)))


_INGRESS = IngressMetrics()


def ingress_metrics() -> IngressMetrics:
    """The ingress process's counters, shared by its middleware and the ingress class. Serve ships
    that class by value, with copies of the module globals its methods read, so a global
    IngressMetrics would be two objects; a function is shipped by reference and returns the one."""
    return _INGRESS
