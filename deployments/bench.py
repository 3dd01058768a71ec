"""`eagleserve bench`: offline throughput through the Ray path (one TP group + the coordinator),
in the manner of trtllm-bench / vllm bench. Every combination of the given modes, K values, CUDA
graphs on/off, overlap on/off and batch sizes runs on the same prompts; one engine per
(speculation, K, graphs), reused across batch sizes and overlap settings. The runs' table and plot:
bench_report.py."""

import itertools
import queue
import time
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from deployments.gpu_utilization import GpuUtilization
from speculative.config import EngineConfig, SamplingParams

WARM_TOKENS = 16  # per request of the untimed run before each timed load


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.array(values) * 1000
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def _stream_all(
    coordinator, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> tuple[int, list[float], list[float]]:
    """Keep `concurrency` requests in flight until all prompts are done; the output tokens, each
    request's seconds to its first token and every inter-token latency."""
    sink: queue.Queue = queue.Queue()
    submitted, done, tokens = 0, 0, 0
    sent_at, last_at, ttft, itl = {}, {}, [], []
    while done < len(prompts):
        while submitted < len(prompts) and submitted - done < concurrency:
            rid = f"bench-{time.monotonic_ns()}-{submitted}"
            coordinator.add(rid, prompts[submitted], params, sink)
            sent_at[rid] = time.perf_counter()
            submitted += 1
        item = sink.get(timeout=600)
        if item is None:
            continue
        if isinstance(item, Exception):
            raise item
        now, rid, n = time.perf_counter(), item.request_id, len(item.new_token_ids)
        if n:
            if rid not in last_at:
                ttft.append(now - sent_at[rid])
            else:  # a value per token: a step's accepted drafts arrive together
                itl += [(now - last_at[rid]) / n] * n
            last_at[rid] = now
            tokens += n
        if item.finish_reason is not None:
            done += 1
    return tokens, ttft, itl


def _acceptance(before: dict, after: dict) -> dict:
    """Draft acceptance between two coordinator.stats()."""
    verify_rows = after["num_verify_rows"] - before["num_verify_rows"]
    accepted = after["draft_accepted"] - before["draft_accepted"]
    return {
        "mean_acceptance_length": 1 + accepted / verify_rows if verify_rows else 1.0,
        "acceptance_per_position": [
            (a - b) / verify_rows if verify_rows else 0.0
            for a, b in zip(after["accepted_at"], before["accepted_at"])
        ],
    }


def _rows(stats: dict) -> int:
    """Rows of requests still running, over every step so far."""
    return stats["num_rows"] - stats["num_extra_rows"]


def _utilization(before: dict, after: dict, wall: float, nvml_busy: float | None) -> dict:
    """How busy the GPU was, the share of rows in extra target passes and how long the
    coordinator waited, between two coordinator.stats()."""
    rows = after["num_rows"] - before["num_rows"]
    return {
        # CUDA events from each step's first kernel to its results copy: gaps inside a step count
        # as busy, so with overlap this reads ~100% whatever the GPU does (NVML's figure does not)
        "gpu_busy_fraction": (after["device_s"] - before["device_s"]) / wall
        if after["device_s"]
        else None,
        "nvml_busy_fraction": nvml_busy,
        "extra_pass_share": (after["num_extra_rows"] - before["num_extra_rows"]) / rows
        if rows
        else 0.0,
        "coordinator_wait_fraction": (after["wait_s"] - before["wait_s"]) / wall,
    }


def run_load(
    coordinator,
    prompts: list[list[int]],
    params: SamplingParams,
    concurrency: int,
    measure_gpu: bool = True,
) -> dict:
    """Keep `concurrency` requests in flight until all prompts are done; time every delta."""
    before = coordinator.stats()
    with GpuUtilization(measure_gpu) as utilization:
        start = time.perf_counter()
        tokens, ttft, itl = _stream_all(coordinator, prompts, params, concurrency)
        wall = time.perf_counter() - start
    after = coordinator.stats()
    return {
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(prompts) / wall,
        **_acceptance(before, after),
        # output tokens per request per step, K=0 rows included (the acceptance length counts
        # only the rows that verified drafts)
        "tokens_per_step": tokens / max(1, _rows(after) - _rows(before)),
        # num_draft_tokens auto: the steps that chose each K
        "auto_steps_by_k": [
            a - b for a, b in zip(after["auto_steps_by_k"], before["auto_steps_by_k"])
        ],
        "ttft_ms": _percentiles(ttft),
        "itl_ms": _percentiles(itl),
        **_utilization(before, after, wall, utilization.busy_fraction),
    }


def _encode_prompts(model: str, prompts_text: list[str]) -> list[list[int]]:
    """The prompts as token ids, through the model's tokenizer and chat template."""
    from speculative.engine.llm_engine import encode_prompt
    from workers.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer to encode the benchmark's prompts")
    return [encode_prompt(tokenizer, p) for p in prompts_text]


class EngineVariant(NamedTuple):
    """One engine the benchmark starts; K and siblings are 0 for plain decoding."""

    mode: str  # "plain", "eagle" or "ngram" (drafts without a drafter)
    k: int | str  # or "auto"
    siblings: int
    cuda_graphs: bool


def _engine_variants(
    modes: list[str], ks: list[int], siblings: list[int], graphs: list[bool]
) -> list[EngineVariant]:
    return [
        EngineVariant(m, k, s, g)
        for m in modes
        for k in (ks if m != "plain" else [0])
        for s in (siblings if m == "eagle" else [0])
        for g in graphs
    ]


def _engine_config(
    variant: EngineVariant, drafter: str, prompt_lookup: float, **shared
) -> EngineConfig:
    """The variant's engine; only EAGLE-3 gets the drafter and prompt lookup. `shared`: the
    EngineConfig fields every variant has in common."""
    eagle = variant.mode == "eagle"
    return EngineConfig(
        drafter=drafter if eagle else {"plain": "none", "ngram": "ngram"}[variant.mode],
        num_draft_tokens="auto" if variant.k == "auto" else max(variant.k, 1),
        cuda_graphs=variant.cuda_graphs,
        prompt_lookup=prompt_lookup if eagle else 0.0,
        draft_siblings=variant.siblings,
        **shared,
    )


def _run_engine(
    cfg: EngineConfig,
    prompts: list[list[int]],
    params: SamplingParams,
    loads: list[tuple[int, bool]],
    prompts_per_batch: int,
    bar: tqdm,
) -> tuple[float, list[dict]]:
    """Start one engine and run a load at every (batch, overlap) of `loads`, each after an untimed
    run of its batch (WARM_TOKENS tokens a request: its graphs and kernels run once): its
    startup seconds and each load's run_load result."""
    from speculative.engine.coordinator import Coordinator

    start = time.perf_counter()
    coordinator = Coordinator(cfg)
    startup_s = time.perf_counter() - start
    results, measure_gpu = [], cfg.device != "cpu"
    try:
        warm = params.model_copy(update={"max_tokens": min(params.max_tokens, WARM_TOKENS)})
        for batch, overlap in loads:
            coordinator.engine.overlap = overlap
            n = max(prompts_per_batch, 2 * batch)
            repeated = (prompts * (n // len(prompts) + 1))[:n]
            run_load(coordinator, repeated[:batch], warm, batch, measure_gpu=False)  # untimed
            results.append(run_load(coordinator, repeated, params, batch, measure_gpu=measure_gpu))
            bar.update()
    finally:
        coordinator.shutdown()
    return startup_s, results


def _run_rows(
    variant: EngineVariant, cfg: EngineConfig, startup_s: float, loads, logprobs, temperature
) -> list[dict]:
    """A row per load of one engine: the run's settings, then run_load's result."""
    eagle = variant.mode == "eagle"
    settings = {
        "graph_first_draft": cfg.graph_first_draft and variant.cuda_graphs and eagle,
        "prompt_lookup": cfg.prompt_lookup,
        "logprobs": logprobs,
        "temperature": temperature,
        "startup_s": startup_s,
    }
    return [
        {**variant._asdict(), "overlap": overlap, "batch": batch, **settings, **result}
        for (batch, overlap), result in loads
    ]


def bench(
    model: str,
    drafter: str,
    ks: list[int],
    modes: list[str],
    graphs: list[bool],
    overlaps: list[bool],
    batches: list[int],
    prompts_text: list[str],
    output_len: int,
    ignore_eos: bool,
    device: str,
    max_model_len: int,
    prompts_per_batch: int,
    graph_first_draft: bool = False,
    prompt_lookup: float = 0.0,
    logprobs: int | None = None,
    siblings: list[int] = (0,),
    temperature: float = 0.0,
    **engine_options,  # more EngineConfig fields (KV pool sizing, prefix caching)
) -> list[dict]:
    prompts = _encode_prompts(model, prompts_text)
    params = SamplingParams(
        max_tokens=output_len, ignore_eos=ignore_eos, logprobs=logprobs, temperature=temperature
    )
    shared = dict(
        model=model,
        max_batch_size=max(batches),
        max_model_len=max_model_len,
        device=device,
        graph_first_draft=graph_first_draft,
        **engine_options,
    )
    engines = _engine_variants(modes, ks, siblings, graphs)
    runs = []
    # plain decoding runs once per batch size, with the first overlap setting asked for
    bar = tqdm(
        total=sum(len(batches) * (len(overlaps) if v.mode != "plain" else 1) for v in engines),
        desc="bench",
    )
    for variant in engines:
        cfg = _engine_config(variant, drafter, prompt_lookup, **shared)
        loads = list(
            itertools.product(batches, overlaps if variant.mode != "plain" else overlaps[:1])
        )
        startup_s, results = _run_engine(cfg, prompts, params, loads, prompts_per_batch, bar)
        runs += _run_rows(variant, cfg, startup_s, zip(loads, results), logprobs, temperature)
    bar.close()
    return runs
