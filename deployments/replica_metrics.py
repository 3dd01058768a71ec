"""One LLM server replica's Prometheus metrics, by vLLM's names (`vllm:...`, labels `model_name`
and `engine`) plus a `replica` label, so that dashboards made for vLLM read them unchanged: the
request histograms and counters observed as the replica streams (prometheus_client), and the
engine's counters and gauges read from its statistics when the replica reports. A snapshot is
plain tuples, which the ingress merges with the other replicas' (deployments/metrics.py)."""

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's finished_reason values
LABELS = ("model_name", "engine", "replica")


def token_buckets(max_value: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to max_value: 1, 2, 5, 10, 20, 50, ..."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class RequestMetrics:
    """The per-request series of one replica, each bound to its labels."""

    def __init__(self, registry: CollectorRegistry, labels: dict, max_model_len: int):
        def histogram(name, doc, buckets):
            metric = Histogram(name, doc, LABELS, buckets=buckets, registry=registry)
            return metric.labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, LABELS, registry=registry).labels(**labels)

        tokens = token_buckets(max_model_len)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two outputs of a request in seconds (a step's tokens come at once).",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "A request's decode time over its output tokens after the first, in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_lengths = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a request.", tokens
        )
        self.output_lengths = histogram(
            "vllm:request_generation_tokens", "Generated tokens of a request.", tokens
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        self.success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}


class RequestTimer:
    """One request's timeline on the replica: arrival, each output, the end."""

    def __init__(self, metrics: RequestMetrics, num_prompt_tokens: int):
        self.metrics, self.num_prompt_tokens = metrics, num_prompt_tokens
        self.arrival = time.perf_counter()
        self.first = self.last = None
        self.num_tokens = 0
        self.is_finished = False

    def output(self, num_new_tokens: int, finish_reason: str | None) -> None:
        now, m = time.perf_counter(), self.metrics
        if num_new_tokens:
            if self.first is None:
                m.ttft.observe(now - self.arrival)
                m.prompt_tokens.inc(self.num_prompt_tokens)
                self.first = now
            else:  # as vLLM: one interval per output, however many tokens it carries
                m.itl.observe(now - self.last)
            self.last = now
            self.num_tokens += num_new_tokens
            m.generation_tokens.inc(num_new_tokens)
        if finish_reason is not None:
            self.finish(finish_reason)

    def finish(self, reason: str) -> None:
        """Count the request once, by why it ended ("abort": the caller went away)."""
        if self.is_finished:
            return
        self.is_finished, m = True, self.metrics
        m.e2e.observe(time.perf_counter() - self.arrival)
        m.success[reason if reason in m.success else "abort"].inc()
        m.prompt_lengths.observe(self.num_prompt_tokens)
        m.output_lengths.observe(self.num_tokens)
        if self.num_tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.num_tokens - 1))


class ReplicaMetrics:
    def __init__(self, model_name: str, replica: str, max_model_len: int):
        self.labels = {"model_name": model_name, "engine": "0", "replica": replica}
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = RequestMetrics(self.registry, self.labels, max_model_len)

    def start_request(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self.requests, num_prompt_tokens)

    def snapshot(self, engine_stats: dict) -> list[tuple]:
        """Plain data for the registry actor: the request series and the engine's."""
        return plain([*self.registry.collect(), *engine_families(engine_stats, self.labels)])


def plain(families) -> list[tuple]:
    """[(name, help, type, [(sample name, labels, value)])], the `_created` samples left out
    (vLLM's dashboards read none)."""
    return [
        (
            f.name,
            f.documentation,
            f.type,
            [(s.name, s.labels, s.value) for s in f.samples if not s.name.endswith("_created")],
        )
        for f in families
    ]


# name -> (help, key in Coordinator.stats() or its "scheduler" part)
ENGINE_GAUGES = {
    "vllm:num_requests_running": ("Requests in the running batch.", "num_requests_running"),
    "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", "num_requests_waiting"),
    "vllm:kv_cache_usage_perc": ("KV-cache usage; 1 means 100 percent.", "kv_cache_usage_perc"),
    "eagleserve_healthy": ("1 while the replica's engine runs.", "healthy"),
}
ENGINE_COUNTERS = {
    "vllm:prefix_cache_queries": ("Prefix cache queries, in tokens.", "prefix_cache_queries_total"),
    "vllm:prefix_cache_hits": ("Prefix cache hits, in tokens.", "prefix_cache_hits_total"),
    "vllm:num_preemptions": ("Preemptions by the scheduler.", "num_preemptions_total"),
    "eagleserve_engine_steps": ("Engine steps.", "num_steps"),
    "eagleserve_extra_pass_rows": (
        "Rows of requests that had already ended (the overlap's extra pass).",
        "num_extra_rows",
    ),
}
# a draft is one request's verify step (vLLM's); accepted_per_pos counts the drafts whose token at
# each position (from 0) was accepted
SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": ("Speculative drafts verified.", "num_verify_rows"),
    "vllm:spec_decode_num_draft_tokens": ("Draft tokens verified.", "draft_proposed"),
    "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted.", "draft_accepted"),
}


def engine_families(stats: dict, labels: dict) -> list:
    """The engine's state (gauges) and running totals (counters) from Coordinator.stats()."""
    values = stats | stats["scheduler"] | {"healthy": int(stats["healthy"])}
    names, label_values = list(labels), list(labels.values())
    kinds = [(GaugeMetricFamily, ENGINE_GAUGES), (CounterMetricFamily, ENGINE_COUNTERS)]
    if stats["accepted_at"]:  # the engine speculates (as vLLM: none without a draft method)
        kinds.append((CounterMetricFamily, SPEC_DECODE_COUNTERS))
    families = []
    for kind, series in kinds:
        for name, (documentation, key) in series.items():
            family = kind(name, documentation, labels=names)
            family.add_metric(label_values, values[key])
            families.append(family)
    if stats["accepted_at"]:
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by draft position.",
            labels=[*names, "position"],
        )
        for position, n in enumerate(stats["accepted_at"]):
            per_pos.add_metric([*label_values, str(position)], n)
        families.append(per_pos)
    if any(stats.get("auto_steps_by_k", ())):
        chosen = CounterMetricFamily(
            "eagleserve_spec_decode_auto_steps",
            "Steps by the draft length that num_draft_tokens auto chose for them.",
            labels=[*names, "num_draft_tokens"],
        )
        for k, n in enumerate(stats["auto_steps_by_k"]):
            chosen.add_metric([*label_values, str(k)], n)
        families.append(chosen)
    return families
