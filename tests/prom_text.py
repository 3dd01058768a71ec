"""A /metrics scrape read with prometheus_client's own parser, sums over series (replicas), and
the metric names a dashboard's PromQL reads."""

import re
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]  # (sample name, its labels) -> value

# PromQL words that are not metric names: functions come before "(", these do not always
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "inf", "nan"}


def scrape(base_url: str) -> Samples:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over its series whose labels include `labels` (over the replicas)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def label_sets(samples: Samples, name: str) -> list[dict]:
    return [dict(ls) for n, ls in samples if n == name]


def scrape_until(base_url: str, done, timeout_s: float = 15) -> Samples:
    """Scrape until done(samples) (replicas report after each request, asynchronously)."""
    deadline = time.time() + timeout_s
    while not done(samples := scrape(base_url)) and time.time() < deadline:
        time.sleep(0.25)
    return samples


def promql_metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (inside braces, or the lists of by/without/on/ignoring/group_*), durations or
    Grafana variables."""
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", "", expr)  # matchers, ranges, variables
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if m.group(2) is None and m.group(1).lower() not in KEYWORDS:
            names.add(m.group(1))
    return names
