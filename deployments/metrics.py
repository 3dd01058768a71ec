"""Prometheus text exposition for the ingress's counters and the engine's statistics."""

import bisect
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.requests = defaultdict(int)  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram()
        self.itl = Histogram()

    def render(self, engine: dict) -> str:
        lines = ["# TYPE eagleserve_requests_total counter"]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(
                f'eagleserve_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}'
            )
        lines += [
            "# TYPE eagleserve_prompt_tokens_total counter",
            f"eagleserve_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE eagleserve_completion_tokens_total counter",
            f"eagleserve_completion_tokens_total {self.completion_tokens}",
            "# TYPE eagleserve_time_to_first_token_seconds histogram",
            *self.ttft.lines("eagleserve_time_to_first_token_seconds"),
            "# TYPE eagleserve_inter_token_latency_seconds histogram",
            *self.itl.lines("eagleserve_inter_token_latency_seconds"),
        ]
        proposed, accepted, verify_rows = (
            engine["draft_proposed"],
            engine["draft_accepted"],
            engine["num_verify_rows"],
        )
        gauges = {
            "batch_size": engine["num_running"],
            "queue_depth": engine["num_waiting"],
            "mean_acceptance_length": 1 + accepted / verify_rows if verify_rows else 1.0,
            "healthy": int(engine["healthy"]),
        }
        for name, value in gauges.items():
            lines += [f"# TYPE eagleserve_{name} gauge", f"eagleserve_{name} {value}"]
        counters = {
            "draft_tokens_proposed_total": proposed,
            "draft_tokens_accepted_total": accepted,
            "engine_steps_total": engine["num_steps"],
            "extra_pass_rows_total": engine["num_extra_rows"],
        }
        for name, value in counters.items():
            lines += [f"# TYPE eagleserve_{name} counter", f"eagleserve_{name} {value}"]
        for name, value in engine.get("scheduler", {}).items():  # vLLM's names, our prefix
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# TYPE eagleserve_{name} {kind}", f"eagleserve_{name} {value}"]
        lines.append("# TYPE eagleserve_acceptance_rate gauge")
        for position, n in enumerate(engine["accepted_at"]):
            rate = n / verify_rows if verify_rows else 0.0
            lines.append(f'eagleserve_acceptance_rate{{position="{position + 1}"}} {rate:.4f}')
        return "\n".join(lines) + "\n"


_INGRESS = Metrics()


def ingress_metrics() -> Metrics:
    """The ingress process's counters, shared by its middleware and the ingress class. Serve ships
    that class by value, with copies of the module globals its methods read, so a global Metrics
    would be two objects; a function is shipped by reference and returns the one."""
    return _INGRESS
