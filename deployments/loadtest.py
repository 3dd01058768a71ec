"""`eagleserve loadtest`: an async HTTP load generator against a running OpenAI-compatible server,
in the manner of `vllm bench serve`. Per level (a concurrency, or a Poisson arrival rate) it sends
streaming requests until `num_requests` are done or `duration_s` has passed (requests in flight then
still finish, each within `timeout_s`), and reports throughput, TTFT, inter-token latency and
end-to-end latency percentiles, and errors by kind."""

import asyncio
import ipaddress
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from deployments.bench import _percentiles

LOOPBACK_NAMES = {"localhost"}


@dataclass
class RequestResult:
    sent: float  # perf_counter() when the request was sent
    first: float | None = None  # first chunk carrying text
    chunks: list[float] = field(default_factory=list)  # every chunk carrying text (ITL: gaps)
    done: float | None = None  # `data: [DONE]`
    num_tokens: int = 0  # usage.completion_tokens, else text chunks
    tokens_estimated: bool = False  # no usage: num_tokens counts text chunks
    error: str | None = None  # "429", "401", "timeout", "connection", "stream_error"


def check_url(url: str, allow_remote: bool) -> str:
    """The server's base URL (without /v1). Refuses a non-loopback host unless allow_remote."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url {url!r} is not an http(s) URL")
    host = parts.hostname
    try:
        loopback = host in LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not loopback and not allow_remote:
        raise ValueError(
            f"--url host {host!r} is not loopback (127.0.0.1, localhost, ::1); "
            "pass --allow-remote to load a remote server"
        )
    return url.rstrip("/").removesuffix("/v1")


def request_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool
) -> dict:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # an eagleserve (and vLLM) extension: fixed output lengths
        body["ignore_eos"] = True
    if endpoint == "chat":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


async def send_one(
    client: httpx.AsyncClient, url: str, body: dict, timeout_s: float
) -> RequestResult:
    """One streaming request, timed chunk by chunk; never raises, records the error kind instead."""
    r = RequestResult(sent=time.perf_counter())
    num_text_chunks, usage = 0, None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    r.error = str(resp.status_code)
                    return r
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):  # SSE: the space after the colon is optional
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        r.done = time.perf_counter()
                        break
                    event = json.loads(data)
                    if "error" in event:  # the stream had started: errors come in-band
                        r.error = "stream_error"
                        return r
                    usage = event.get("usage") or usage
                    choice = (event.get("choices") or [{}])[0]
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        r.chunks.append(time.perf_counter())
                        num_text_chunks += 1
    except (TimeoutError, httpx.TimeoutException):
        r.error = "timeout"
    except httpx.TransportError:
        r.error = "connection"
    except (json.JSONDecodeError, TypeError, AttributeError, IndexError):
        r.error = "stream_error"  # not the events a stream must send
    if r.error is None and r.done is None:
        r.error = "stream_error"  # ended without [DONE]
    r.first = r.chunks[0] if r.chunks else None
    counted = usage.get("completion_tokens") if isinstance(usage, dict) else None
    r.tokens_estimated = not isinstance(counted, int)
    r.num_tokens = num_text_chunks if r.tokens_estimated else counted
    return r


def _client(api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # trust_env=False: a proxy from the environment must not intercept loopback traffic
    return httpx.AsyncClient(
        headers=headers,
        timeout=timeout_s,
        trust_env=False,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def _closed_loop(send, bodies: list[dict], concurrency: int, deadline: float) -> None:
    """`concurrency` workers, each sending its next body once its last one is done."""
    todo = iter(bodies)

    async def worker():
        for body in todo:  # one shared iterator: the workers take turns
            if time.perf_counter() >= deadline:
                return
            await send(body)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(send, bodies: list[dict], rate: float, seed: int, deadline: float) -> None:
    """The bodies sent at Poisson arrivals of `rate` per second, whatever is still in flight."""
    rng, tasks = random.Random(seed), []
    for i, body in enumerate(bodies):
        if i:
            await asyncio.sleep(rng.expovariate(rate))  # exponential gaps: Poisson arrivals
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(send(body)))
    await asyncio.gather(*tasks)


async def run_level(
    url: str,
    bodies: list[dict],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    duration_s: float = 60.0,
    timeout_s: float = 120.0,
    api_key: str | None = None,
    seed: int = 0,
    desc: str = "",
) -> tuple[list[RequestResult], float]:
    """Closed loop (`concurrency` requests always in flight) or open loop (Poisson arrivals at
    `rate` req/s) over `bodies`, until all are sent or `duration_s` passes. Returns the results and
    the wall time."""
    assert (concurrency is None) != (rate is None)
    client = _client(api_key, timeout_s)
    endpoint = url + ("/v1/chat/completions" if "messages" in bodies[0] else "/v1/completions")
    bar = tqdm(total=len(bodies), desc=desc, leave=False)
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + duration_s

    async def send(body):
        results.append(await send_one(client, endpoint, body, timeout_s))
        bar.update()

    async with client:
        if concurrency is not None:
            await _closed_loop(send, bodies, concurrency, deadline)
        else:
            await _open_loop(send, bodies, rate, seed, deadline)
    bar.close()
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.num_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "output_tokens": tokens,
        "tokens_estimated": any(r.tokens_estimated for r in ok),
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s,
        "requests_per_s": len(ok) / wall_s,
        "ttft_ms": _percentiles([r.first - r.sent for r in ok if r.first is not None]),
        # a chunk may carry several tokens (accepted drafts): this is the gap between chunks
        "itl_ms": _percentiles([b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]),
        "e2e_ms": _percentiles([r.done - r.sent for r in ok]),
    }


def loadtest(
    url: str,
    prompts: list[str],
    *,
    concurrency: list[int] | None = None,
    rate: list[float] | None = None,
    num_requests: int = 64,
    duration_s: float = 60.0,
    model: str = "smollm2-135m",
    endpoint: str = "chat",
    max_tokens: int = 64,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    timeout_s: float = 120.0,
    api_key: str | None = None,
    seed: int = 0,
) -> list[dict]:
    """One summary per level: every concurrency in `concurrency`, or every rate in `rate`."""
    if not prompts:
        raise ValueError("no prompts to send")
    bodies = [
        request_body(
            endpoint, model, prompts[i % len(prompts)], max_tokens, temperature, ignore_eos
        )
        for i in range(num_requests)
    ]
    levels = (
        [("concurrency", c) for c in concurrency] if concurrency else [("rate", r) for r in rate]
    )
    runs = []
    for kind, value in levels:
        results, wall_s = asyncio.run(
            run_level(
                url,
                bodies,
                duration_s=duration_s,
                timeout_s=timeout_s,
                api_key=api_key,
                seed=seed,
                desc=f"{kind} {value}",
                **{kind: value},
            )
        )
        runs.append({kind: value, **summarize(results, wall_s)})
    return runs


def print_table(runs: list[dict]) -> None:
    kind = "concurrency" if "concurrency" in runs[0] else "rate"
    print(
        f"{kind:>11} {'ok':>5} {'errors':>12} {'tok/s':>8} {'req/s':>6} {'ttft p50':>9} "
        f"{'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} {'e2e p50':>9} {'e2e p99':>9}"
    )
    ms = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    for r in runs:
        errors = ",".join(f"{k}:{n}" for k, n in sorted(r["errors"].items())) or "-"
        print(
            f"{r[kind]:>11} {r['num_ok']:>5} {errors:>12} {r['output_tokens_per_s']:>8.1f} "
            f"{r['requests_per_s']:>6.2f} "
            f"{ms(r['ttft_ms']['p50']):>9} {ms(r['ttft_ms']['p99']):>9} "
            f"{ms(r['itl_ms']['p50']):>8} {ms(r['itl_ms']['p99']):>8} "
            f"{ms(r['e2e_ms']['p50']):>9} {ms(r['e2e_ms']['p99']):>9}"
        )
    print("(latencies in ms; itl is the gap between streamed chunks)")
    if any(r["tokens_estimated"] for r in runs):
        print(
            "(the server sent no usage: output tokens are counted as text chunks, an underestimate)"
        )


def plot(runs: list[dict], path: Path) -> bool:
    """Throughput and TTFT p50 against the level; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kind = "concurrency" if "concurrency" in runs[0] else "rate"
    x = [r[kind] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [r["output_tokens_per_s"] for r in runs], marker="o")
    left.set_ylabel("output tokens/s")
    right.plot(x, [r["ttft_ms"]["p50"] or 0 for r in runs], marker="o", color="tab:orange")
    right.set_ylabel("TTFT p50 (ms)")
    for ax in (left, right):
        ax.set_xlabel("concurrent requests" if kind == "concurrency" else "arrival rate (req/s)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
