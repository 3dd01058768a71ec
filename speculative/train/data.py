"""Training data: prompts, self-distilled sequences (prompt + the target's own response) stored
as flat token arrays with offsets in safetensors, the draft vocabulary, and length-bucketed
batches. Target features and distributions are not stored: they are recomputed per batch.

The data directory holds the distilled sequences in parts (part-00000.safetensors, ...), one
sequence per prompt of the distillation order, in that order. A distillation run continues the
order after the prompts the parts already hold, so jobs of a few minutes each (the H200 machine's
limit) grow one dataset, and each part stays small enough to travel between machines."""

import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from tqdm import tqdm

from speculative.jsonl import read_rows
from speculative.train.config import DistillConfig


@dataclass
class TokenStore:
    tokens: np.ndarray  # [num_tokens] int32, sequences back to back
    offsets: np.ndarray  # [num_seqs + 1] int64
    prompt_lens: np.ndarray  # [num_seqs] int32

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_lists(cls, seqs: list[list[int]], prompt_lens: list[int]) -> "TokenStore":
        lens = np.array([len(s) for s in seqs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = (
            np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
            if seqs
            else np.zeros(0, np.int32)
        )
        return cls(flat, offsets, np.asarray(prompt_lens, dtype=np.int32))

    @classmethod
    def concat(cls, stores: list["TokenStore"]) -> "TokenStore":
        offsets = [np.zeros(1, np.int64)]
        for store in stores:
            offsets.append(store.offsets[1:] + offsets[-1][-1])
        return cls(
            np.concatenate([s.tokens for s in stores] + [np.zeros(0, np.int32)]),
            np.concatenate(offsets),
            np.concatenate([s.prompt_lens for s in stores] + [np.zeros(0, np.int32)]),
        )

    def slice(self, start: int, end: int) -> "TokenStore":
        offsets = self.offsets[start : end + 1]
        return TokenStore(
            self.tokens[offsets[0] : offsets[-1]], offsets - offsets[0], self.prompt_lens[start:end]
        )

    def save(self, path: Path) -> None:
        """uint16 tokens when the vocabulary fits (half the bytes: parts travel between machines).
        Written under another name and renamed: a killed write leaves no part cut short."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tokens = (
            self.tokens.astype(np.uint16)
            if self.tokens.size and self.tokens.max() < 2**16
            else self.tokens
        )
        tmp = path.with_name(path.name + ".tmp")
        save_file(
            {"tokens": tokens, "offsets": self.offsets, "prompt_lens": self.prompt_lens}, str(tmp)
        )
        tmp.rename(path)

    @classmethod
    def load(cls, path: Path) -> "TokenStore":
        try:
            t = load_file(str(path))
            return cls(t["tokens"].astype(np.int32), t["offsets"], t["prompt_lens"])
        except (SafetensorError, KeyError) as e:
            raise ValueError(
                f"data part {path} is unreadable ({e}): cut short by a killed copy? Copy it "
                "again, or delete it and the parts after it and distil them again"
            ) from e


# 12 MB in uint16: a file that comes back from the H200 machine may have at most 16 MiB
MAX_PART_TOKENS = 6_000_000


def data_parts(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("part-*.safetensors"))


def load_data(directory: Path) -> TokenStore:
    """Every part of a data directory, in order, as one store."""
    parts = data_parts(directory)
    if not parts:
        raise FileNotFoundError(f"no self-distilled data (part-*.safetensors) in {directory}")
    missing = sorted(
        {f"part-{i:05d}.safetensors" for i in range(len(parts))} - {p.name for p in parts}
    )
    # the parts hold the order's prompts in turn: without one, the rest are off by its size
    if missing:
        raise ValueError(
            f"data directory {directory} lacks {', '.join(missing)} before "
            f"{parts[-1].name}: restore the parts, or move those after the gap away"
        )
    return TokenStore.concat([TokenStore.load(p) for p in parts])


def save_parts(
    directory: Path, store: TokenStore, max_part_tokens: int = MAX_PART_TOKENS
) -> list[Path]:
    """Append `store` to the directory as parts of at most `max_part_tokens` tokens each."""
    parts = data_parts(directory)
    index = int(parts[-1].stem.removeprefix("part-")) + 1 if parts else 0
    paths, start = [], 0
    while start < len(store):
        end = start + 1
        while end < len(store) and store.offsets[end + 1] - store.offsets[start] <= max_part_tokens:
            end += 1
        paths.append(Path(directory) / f"part-{index + len(paths):05d}.safetensors")
        store.slice(start, end).save(paths[-1])
        start = end
    return paths


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


def draft_vocab(
    store: TokenStore, vocab_size: int, draft_vocab_size: int, always: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The most frequent response tokens -> (d2t [Vd] int64 offsets, t2d [V] bool, coverage).
    Draft ids keep the target order, so target id = draft id + d2t[draft id]."""
    responses = [store.seq(i)[store.prompt_lens[i] :] for i in range(len(store))]
    counts = np.bincount(np.concatenate(responses + [np.zeros(0, np.int32)]), minlength=vocab_size)
    priority = counts.copy()
    priority[list(always)] = counts.max() + 1
    chosen = np.sort(np.argsort(-priority, kind="stable")[:draft_vocab_size])
    coverage = float(counts[chosen].sum() / max(counts.sum(), 1))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    d2t = torch.from_numpy(chosen).long() - torch.arange(draft_vocab_size)
    return d2t, t2d, coverage


# Batches are padded to a multiple of this many tokens, so that few shapes occur. Padded to its
# longest row only, every batch of a 6M-token store's first epoch had a new length, and that epoch
# ran at 1.5 steps/s on the H200 against 8 afterwards (per-shape setup on the GPU, ~0.5 s a shape:
# inferred from those rates, not profiled).
PAD_MULTIPLE = 64


def padded_len(n, multiple: int = PAD_MULTIPLE):
    return -(-n // multiple) * multiple


def batches(
    store: TokenStore, batch_tokens: int, max_seq_len: int, seed: int, epoch: int
) -> list[list[int]]:
    """Length-bucketed batches of sequence indices, each at most `batch_tokens` padded tokens (rows
    padded as `collate` pads them), in a shuffled order that depends only on (seed, epoch), so a
    resumed run sees the same batches."""
    rng = np.random.default_rng([seed, epoch])
    lengths = np.minimum(store.lengths, max_seq_len)
    order = np.argsort(lengths + rng.random(len(lengths)), kind="stable")  # ties shuffled
    lengths = padded_len(lengths)
    out, current = [], []
    for i in order:
        longest = max(lengths[current[0]] if current else 0, lengths[i])
        if current and longest * (len(current) + 1) > batch_tokens:
            out.append(current)
            current = []
        current.append(int(i))
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def collate(
    store: TokenStore,
    indices: list[int],
    max_seq_len: int,
    multiple: int = PAD_MULTIPLE,
    pad_id: int = 0,
):
    """-> ids [B, T] int64 with T padded to `multiple`, lengths [B], prompt_lens [B] (sequences cut
    to max_seq_len)."""
    seqs = [store.seq(i)[:max_seq_len] for i in indices]
    T = padded_len(max(len(s) for s in seqs), multiple)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
    lengths = torch.tensor([len(s) for s in seqs])
    prompt_lens = torch.tensor([int(store.prompt_lens[i]) for i in indices])
    return ids, lengths, prompt_lens
