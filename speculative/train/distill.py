"""Self-distillation: the training prompts in a fixed, seeded order, each answered by the target
itself (greedy, then sampled passes), in waves through the engine or in several engine
processes, stored as TokenStore parts (speculative/train/data.py). A job continues the order
after the prompts the parts already hold, so jobs of a few minutes each grow one dataset."""

import itertools
import random
import time

from tqdm import tqdm

from speculative.jsonl import read_rows
from speculative.train.config import DistillConfig
from speculative.train.data import TokenStore


def read_prompts(files: list[str]) -> list[str]:
    """Prompts from JSONL(.gz) files: field "prompt" (training prompts) or "question" (GSM8K)."""
    prompts = []
    for file in files:
        for where, row in read_rows(file):
            prompt = (row.get("prompt") or row.get("question")) if isinstance(row, dict) else None
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f'{where}: no non-empty "prompt" or "question" string')
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"the prompt files {', '.join(map(str, files))} hold no prompts")
    return prompts


def distill_order(cfg: DistillConfig, tokenizer, skip: int = 0):
    """-> (number of prompts to distil, iterator of (prompt ids, SamplingParams) over the order
    after its first `skip` prompts). Passes after the first go through the order again, sampled;
    `num_prompts` counts from the start of the order. A prompt's parameters depend on the seed and
    its place in the order only, so jobs that continue each other give what one job would."""
    from speculative.config import SamplingParams
    from speculative.engine.llm_engine import encode_chats

    texts = prompt_order(read_prompts(cfg.prompt_files), cfg)
    chunk = 4 * cfg.max_batch_size

    def encoded():  # a chunk at a time: the fast tokenizer encodes a batch in parallel
        for start in range(0, len(texts), chunk):
            yield from encode_chats(
                tokenizer, [[{"role": "user", "content": t}] for t in texts[start : start + chunk]]
            )

    passes = (
        (p, k, ids)
        for p in range(cfg.num_passes)
        for k, ids in enumerate(length_sorted_chunks(encoded(), chunk, cfg.max_prompt_len))
    )

    def order():
        greedy = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)
        for p, k, ids in itertools.islice(passes, skip, None):
            # a str seed: hashed the same in every process
            rng = random.Random(f"{cfg.seed}/{p}/{k}")
            sampled = rng.random() < cfg.sampled_fraction or p > 0
            yield (
                ids,
                (
                    SamplingParams(
                        temperature=cfg.temperature,
                        max_tokens=cfg.max_tokens,
                        seed=rng.randrange(2**31),
                    )
                    if sampled
                    else greedy
                ),
            )

    return max(min(cfg.num_prompts, len(texts) * cfg.num_passes) - skip, 0), order()


def distill_jobs(order, num_prompts: int, time_limit_s: float | None):
    """(index, prompt ids, params) for the first `num_prompts` of `order`, until the time limit
    (checked before taking each, so that no prompt is taken and dropped)."""
    start = time.perf_counter()
    for index in range(num_prompts):
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            return
        item = next(order, None)
        if item is None:
            return
        yield index, *item


def generate_in_waves(engine, jobs):
    """Run (key, prompt ids, params) jobs through the engine; yields (key, prompt ids, response) as
    each finishes. A response that ended on EOS keeps that EOS, so the drafter learns where answers
    stop. Jobs are admitted in waves once a quarter of the slots are free: a step that carries a
    prefill runs eager and costs as much as many graphed decode steps, so one prefill per finished
    request would make the generation several times slower."""
    eos = engine.tokenizer.eos_token_id
    # no detokenizing: nothing reads the text, and it costs host time
    engine.scheduler.tokenizer = None
    num_slots, running, is_admitting = engine.executor.num_slots, {}, True
    while is_admitting or engine.has_work:
        num_busy = engine.scheduler.num_waiting + engine.scheduler.num_running
        if is_admitting and num_busy <= num_slots * 3 // 4:
            for _ in range(num_slots - num_busy):
                job = next(jobs, None)
                if job is None:
                    is_admitting = False
                    break
                key, ids, params = job
                request = engine.add_request(ids, params)
                running[request.request_id] = key, request
        for out in engine.step():
            if out.finish_reason is not None:
                key, r = running.pop(out.request_id)
                yield (
                    key,
                    r.prompt_ids,
                    r.output_ids + ([eos] if r.finish_reason == "stop" and eos is not None else []),
                )


def self_distill(engine, cfg: DistillConfig, skip: int = 0) -> TokenStore:
    """Regenerate responses with the target through our engine (drafter "none") for the prompts of
    the distillation order after the first `skip` (those earlier runs covered), until the time limit
    stops admission. Every prompt taken, distilled or kept undistilled, becomes one
    sequence, in order."""
    total, order = distill_order(cfg, engine.tokenizer, skip)
    results = tqdm(
        generate_in_waves(engine, distill_jobs(order, total, cfg.time_limit_s)),
        total=total,
        desc="self-distillation",
        unit="seq",
    )
    return _distilled_store(
        {key: (prompt, response) for key, prompt, response in results}, order, cfg
    )


def self_distill_in_processes(engine_cfg, cfg: DistillConfig, skip: int = 0) -> TokenStore:
    """`self_distill` with `cfg.num_workers` engines, each in a process of its own on the one
    device: while one process's host works (scheduling, eager prefill launches), the GPU can run
    another's kernels. One queue hands out the prompts in order: whenever the time limit stops
    admission, the prompts taken are the order's first ones."""
    import multiprocessing
    import threading

    from workers.models.loader import load_tokenizer, resolve_model

    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    jobs, results = ctx.Queue(maxsize=cfg.max_batch_size), ctx.Queue()
    workers = [
        ctx.Process(target=_distill_worker, args=(engine_cfg, jobs, results), daemon=True)
        for _ in range(cfg.num_workers)
    ]
    for w in workers:
        w.start()
    finished = False
    try:
        total, order = distill_order(cfg, load_tokenizer(resolve_model(engine_cfg.model)), skip)
        for _ in workers:  # each engine's "ready": the time limit counts from when all are
            _next_result(results, workers)

        def feed():
            for job in distill_jobs(order, total, cfg.time_limit_s):
                jobs.put(job)
            for _ in workers:
                jobs.put(None)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        done, num_finished = {}, 0
        with tqdm(
            total=total, desc=f"self-distillation ({len(workers)} processes)", unit="seq"
        ) as bar:
            while num_finished < len(workers):
                result = _next_result(results, workers)
                if result == "done":
                    num_finished += 1
                else:
                    done[result[0]] = result[1:]
                    bar.update()
        feeder.join()
        finished = True
    finally:
        for w in workers:
            if not finished:  # an error: the other engines must not wait for jobs forever
                w.terminate()
            w.join()
    return _distilled_store(done, order, cfg)


def _distill_worker(engine_cfg, jobs, results) -> None:
    from speculative.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_cfg)
    results.put("ready")
    for result in generate_in_waves(engine, iter(jobs.get, None)):
        results.put(result)
    results.put("done")


def _next_result(results, workers):
    import queue

    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                raise RuntimeError(
                    "a self-distillation process died (its traceback is above)"
                ) from None


def _distilled_store(done: dict, order, cfg: DistillConfig) -> TokenStore:
    """The sequences of jobs 0..len(done)-1, then (with keep_undistilled_prompts) the prompts left
    in `order` without a response."""
    seqs = [done[i][0] + done[i][1] for i in range(len(done))]
    prompt_lens = [len(done[i][0]) for i in range(len(done))]
    if cfg.keep_undistilled_prompts:
        rest = [ids for ids, _ in tqdm(order, desc="undistilled prompts", unit="prompt")]
        seqs += rest
        prompt_lens += [len(ids) for ids in rest]
    return TokenStore.from_lists(seqs, prompt_lens)


def prompt_order(texts: list[str], cfg: DistillConfig) -> list[str]:
    """Shuffled (seeded), with prompts of at least `long_prompts_first_chars` characters first."""
    texts = list(texts)
    random.Random(cfg.seed).shuffle(texts)
    if cfg.long_prompts_first_chars:
        # stable: each group stays shuffled
        texts.sort(key=lambda t: len(t) < cfg.long_prompts_first_chars)
    return texts


def length_sorted_chunks(encoded, chunk: int, max_len: int):
    """Prompts of at most `max_len` tokens, sorted by length within consecutive chunks: a wave of
    admissions then holds prompts of similar length, so its prefill pads little and the running
    batch reads a smaller KV bucket. Chunks keep the shuffled mix, whenever the time limit stops."""
    kept = (ids for ids in encoded if len(ids) <= max_len)
    while part := list(itertools.islice(kept, chunk)):
        yield from sorted(part, key=len)
