"""`eagleserve bench`: offline throughput through the Ray path (one TP group + the coordinator),
in the manner of trtllm-bench / vllm bench. Every combination of the given modes, K values, CUDA
graphs on/off, overlap on/off and batch sizes runs on the same prompts; one engine per
(speculation, K, graphs), reused across batch sizes and overlap settings. The runs' table and plot:
bench_report.py."""

import itertools
import queue
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from deployments.gpu_utilization import GpuUtilization
from speculative.config import EngineConfig, SamplingParams
from speculative.jsonl import read_rows

DATA = Path(__file__).resolve().parent / "data"  # shipped prompts: data/PROVENANCE.md
GSM8K_TEST = DATA / "gsm8k" / "test.jsonl.gz"
EAGLE_SETS = ("gsm8k", "alpaca", "sum", "qa")


def eagle_set(name: str) -> Path:
    """One of the EAGLE benchmark question sets (EAGLE_SETS), MT-Bench rows."""
    return DATA / "eagle_bench" / f"{name}.jsonl.gz"


def load_prompts(path: str | None, num: int) -> list[str]:
    """The first `num` prompts (0: all) of the shipped GSM8K test questions by default, else of any
    JSONL(.gz) whose rows hold prompt, question or turns[0]."""
    path = Path(path) if path else GSM8K_TEST
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} not found")
    prompts = []
    for where, row in read_rows(path):
        try:
            prompt = (
                row["prompt"]
                if "prompt" in row
                else row["question"]
                if "question" in row
                else row["turns"][0]
            )
        except (TypeError, KeyError, IndexError):
            prompt = None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"{where}: expected a JSON object with a non-empty prompt, question or turns[0]"
            )
        prompts.append(prompt)
        if len(prompts) == num:
            break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.array(values) * 1000
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def run_load(
    coordinator,
    prompts: list[list[int]],
    params: SamplingParams,
    concurrency: int,
    measure_gpu: bool = True,
) -> dict:
    """Keep `concurrency` requests in flight until all prompts are done; time every delta."""
    sink: queue.Queue = queue.Queue()
    before = coordinator.stats()
    device_before = before["device_s"]
    with GpuUtilization(measure_gpu) as utilization:
        start = time.perf_counter()
        submitted, done, tokens = 0, 0, 0
        sent_at, first_at, last_at, itl = {}, {}, {}, []
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
            now = time.perf_counter()
            n = len(item.new_token_ids)
            if n:
                if item.request_id not in first_at:
                    first_at[item.request_id] = now
                else:  # a value per token: a step's accepted drafts arrive together
                    itl += [(now - last_at[item.request_id]) / n] * n
                last_at[item.request_id] = now
                tokens += n
            if item.finish_reason is not None:
                done += 1
        wall = time.perf_counter() - start
    after = coordinator.stats()
    verify_rows = after["num_verify_rows"] - before["num_verify_rows"]
    accepted = after["draft_accepted"] - before["draft_accepted"]
    rows = after["num_rows"] - before["num_rows"]
    return {
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": len(prompts) / wall,
        "mean_acceptance_length": 1 + accepted / verify_rows if verify_rows else 1.0,
        "acceptance_per_position": [
            (a - b) / verify_rows if verify_rows else 0.0
            for a, b in zip(after["accepted_at"], before["accepted_at"])
        ],
        "ttft_ms": _percentiles([first_at[r] - sent_at[r] for r in first_at]),
        "itl_ms": _percentiles(itl),
        # CUDA events from each step's first kernel to its results copy: gaps inside a step count
        # as busy, so with overlap this reads ~100% whatever the GPU does (NVML's figure does not)
        "gpu_busy_fraction": (after["device_s"] - device_before) / wall
        if after["device_s"]
        else None,
        "nvml_busy_fraction": utilization.busy_fraction,
        "extra_pass_share": (after["num_extra_rows"] - before["num_extra_rows"]) / rows
        if rows
        else 0.0,
        "coordinator_wait_fraction": (after["wait_s"] - before["wait_s"]) / wall,
    }


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
    from speculative.coordinator import Coordinator
    from speculative.engine import encode_prompt
    from workers.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer to encode the benchmark's prompts")
    prompts = [encode_prompt(tokenizer, p) for p in prompts_text]
    params = SamplingParams(
        max_tokens=output_len, ignore_eos=ignore_eos, logprobs=logprobs, temperature=temperature
    )
    engines = [
        (m, k, s, g)
        for m in modes
        for k in (ks if m == "eagle" else [0])
        for s in (siblings if m == "eagle" else [0])
        for g in graphs
    ]
    runs = []
    # plain decoding runs once per batch size, with the first overlap setting asked for
    bar = tqdm(
        total=sum(len(batches) * (len(overlaps) if m == "eagle" else 1) for m, *_ in engines),
        desc="bench",
    )
    for mode, k, num_siblings, use_graphs in engines:
        cfg = EngineConfig(
            model=model,
            drafter=drafter if mode == "eagle" else "none",
            num_draft_tokens=max(k, 1),
            max_batch_size=max(batches),
            max_model_len=max_model_len,
            device=device,
            cuda_graphs=use_graphs,
            graph_first_draft=graph_first_draft,
            prompt_lookup=prompt_lookup if mode == "eagle" else 0.0,
            draft_siblings=num_siblings,
            **engine_options,
        )
        start = time.perf_counter()
        coordinator = Coordinator(cfg)
        startup_s = time.perf_counter() - start
        try:
            run_load(coordinator, prompts[:2], params, 2)  # warm-up
            for batch, overlap in itertools.product(
                batches, overlaps if mode == "eagle" else overlaps[:1]
            ):
                coordinator.engine.overlap = overlap
                n = max(prompts_per_batch, 2 * batch)
                result = run_load(
                    coordinator,
                    (prompts * (n // len(prompts) + 1))[:n],
                    params,
                    batch,
                    measure_gpu=device != "cpu",
                )
                runs.append(
                    {
                        "mode": mode,
                        "k": k,
                        "siblings": num_siblings,
                        "cuda_graphs": use_graphs,
                        "overlap": overlap,
                        "batch": batch,
                        "graph_first_draft": graph_first_draft and use_graphs and mode == "eagle",
                        "prompt_lookup": cfg.prompt_lookup,
                        "logprobs": logprobs,
                        "temperature": temperature,
                        "startup_s": startup_s,
                        **result,
                    }
                )
                bar.update()
        finally:
            coordinator.shutdown()
    bar.close()
    return runs
