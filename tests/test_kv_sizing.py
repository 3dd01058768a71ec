"""Sizing the paged KV pool (workers/kv_sizing.py, workers/memory_profile.py): the arithmetic of
each rule, which rule wins, max_model_len's default, the flags that reach it, the GPU path's
orchestration over fake measurements, the profiled peak step on CPU, and the default engine on
the real SmolLM2."""

import logging

import pytest
import torch
from conftest import tiny_engine

from deployments.cli import _engine_config
from deployments.cli_args import build_parser
from deployments.cli_serve import _serve_config
from speculative.config import EngineConfig, SamplingParams
from speculative.engine.block_manager import BlockManager
from speculative.engine.request_blocks import RequestBlocks
from workers import memory_profile
from workers.kv_sizing import (
    CPU_KV_CACHE_GB,
    GiB,
    GpuMemory,
    cache_rows,
    check_holds_a_request,
    cpu_blocks,
    default_slots,
    explicit_blocks,
    full_length_gb,
    gpu_blocks,
    static_pool_size,
)
from workers.models import ModelConfig
from workers.models.loader import resolve_model

SMOL_TOKEN = 47616  # SmolLM2 fp32: 30 layers x 3 KV heads x 64 x (k, v) x 4 bytes, + the drafter's
SMOL_BLOCK = 16 * SMOL_TOKEN
MiB = 2**20


def gpu(**changes) -> GpuMemory:
    """An 80 GiB card, 79 GiB free at start; the engine holds 20 GiB, its peak step 4 GiB more,
    its graphs 1 GiB."""
    mem = dict(total=80 * GiB, free_at_start=79 * GiB, engine=20 * GiB)
    return GpuMemory(**(mem | dict(peak_step=4 * GiB, graphs=GiB) | changes))


def test_gpu_blocks_get_what_the_utilization_leaves():
    # 0.9 x 80 = 72 GiB, less 20 + 4 + 1: 47 GiB of blocks
    assert gpu_blocks(gpu(), 0.9, 1 * MiB) == 47 * 1024
    assert gpu_blocks(gpu(), 0.9, 3 * MiB) == 47 * 1024 // 3  # whole blocks only
    assert gpu_blocks(gpu(graphs=0, free_at_start=80 * GiB), 1.0, 1 * MiB) == 56 * 1024
    assert gpu_blocks(gpu(peak_step=51 * GiB), 0.9, MiB) == 0  # nothing left: no block
    assert gpu_blocks(gpu(peak_step=60 * GiB), 0.9, MiB) == 0  # short, not negative


def test_gpu_blocks_respect_other_processes():
    """What other processes hold must leave utilization x the GPU free at start, as in vLLM."""
    mem = gpu(free_at_start=60 * GiB)
    assert gpu_blocks(mem, 0.9, MiB) == 0
    assert gpu_blocks(mem, 0.75, MiB) == 35 * 1024  # 60 GiB asked for, 60 free
    assert "lower gpu_memory_utilization to 0.75 or less" in mem.advice(0.9)
    assert "raise gpu_memory_utilization" in gpu().advice(0.9)


def test_a_pool_too_small_for_one_request_names_the_numbers():
    mem = gpu(peak_step=47 * GiB)
    report = mem.report(0.9)
    assert report.startswith("gpu_memory_utilization=0.9: 72.00 of 80.00 GiB (79.00 GiB free")
    assert "weights and other memory 20.00 GiB, peak step 47.00 GiB, CUDA graphs 1.00 GiB" in report
    with pytest.raises(ValueError) as e:
        check_holds_a_request(0, 513, 8192, report, mem.advice(0.9))
    message = str(e.value)
    assert "gpu_memory_utilization=0.9" in message and "room for 0 KV cache blocks" in message
    assert "one request at max_model_len 8192 needs (513)" in message
    assert "raise gpu_memory_utilization" in message and "kv_cache_memory_gb" in message
    check_holds_a_request(513, 513, 8192, report, "")  # exactly one request: fine


def test_explicit_and_cpu_default_blocks():
    assert explicit_blocks(1.0, SMOL_BLOCK) == GiB // SMOL_BLOCK == 1409
    with pytest.raises(ValueError, match=r"kv_cache_memory_gb=0.0001 holds no KV block"):
        explicit_blocks(0.0001, SMOL_BLOCK)
    # SmolLM2 at 2048: every one of 8 slots at full length (129 blocks each) fits 1 GiB
    assert cpu_blocks(8, 129, SMOL_BLOCK) == 8 * 129
    # at its 8192 positions 8 slots would take 3 GiB: capped at CPU_KV_CACHE_GB
    assert CPU_KV_CACHE_GB == 1.0 and cpu_blocks(8, 513, SMOL_BLOCK) == 1409


def test_cache_rows_match_the_schedulers_blocks():
    """The worker's rows per request and the scheduler's blocks per request must agree."""
    for max_len, k, siblings in ((2048, 5, 0), (8192, 3, 2), (100, 0, 0), (131072, 16, 4)):
        rows = cache_rows(max_len, k, siblings, 16)
        assert rows % 16 == 0 and rows >= max_len + 2 * (k + 1) + k * siblings + 1
        assert RequestBlocks(BlockManager(1, 16), k, k * siblings, max_len).max_blocks * 16 == rows


def test_which_rule_sizes_the_pool():
    """kv_cache_memory_gb always wins; without it CUDA measures (None here) and CPU takes its
    default, which must hold one request at max_model_len."""
    explicit = EngineConfig(kv_cache_memory_gb=0.5, max_batch_size=4)
    for is_cuda in (True, False):
        size = static_pool_size(explicit, SMOL_TOKEN, 8208, 8192, is_cuda)
        assert (size.num_slots, size.num_blocks, size.block_size) == (4, 704, 16)
        assert size.rule == "kv_cache_memory_gb=0.5"
    default = EngineConfig()
    assert static_pool_size(default, SMOL_TOKEN, 8208, 8192, is_cuda=True) is None
    size = static_pool_size(default, SMOL_TOKEN, 8208, 8192, is_cuda=False)
    assert (size.num_slots, size.num_blocks) == (8, 1409) and "CPU default" in size.rule
    # Llama-3.1-8B in fp32 at its 131072 positions: 512 KiB a token, 1 GiB is 2048 tokens
    with pytest.raises(ValueError, match=r"CPU default .* fewer than one request at max_model_len"):
        static_pool_size(default, 2**19, 131088, 131072, is_cuda=False)
    budget = EngineConfig(memory_budget_gb=1.0)  # still caps the slots: 2 of 8208 tokens fit
    assert static_pool_size(budget, SMOL_TOKEN, 8208, 8192, is_cuda=False).num_slots == 2


def test_request_slots_default_as_vllms_max_num_seqs():
    """Unset, max_batch_size is vLLM's 256 on CUDA and 8 on CPU, at most as many rows as one
    step's budget verifies (1 + K(M+1) tokens each) and as the pool holds requests; an explicit
    value stands, past them too."""
    assert EngineConfig().max_batch_size is None
    assert (default_slots(EngineConfig(), True), default_slots(EngineConfig(), False)) == (256, 8)
    assert default_slots(EngineConfig(max_num_batched_tokens=600), True) == 600 // 6  # K=5
    assert default_slots(EngineConfig(max_num_batched_tokens=600, draft_siblings=1), True) == 54
    assert default_slots(EngineConfig(max_num_batched_tokens=600, drafter="none"), True) == 256
    assert default_slots(EngineConfig(max_num_batched_tokens=16, drafter="none"), False) == 8
    # a 64-block pool holds 64 requests of one block (1 + 2 x 6 + 1 rows of K=5)
    tiny_pool = dict(kv_cache_memory_gb=64 * SMOL_BLOCK / GiB)
    assert static_pool_size(EngineConfig(**tiny_pool), SMOL_TOKEN, 1040, 1024, True).num_slots == 64
    explicit = EngineConfig(**tiny_pool, max_batch_size=100, max_num_batched_tokens=16)
    assert static_pool_size(explicit, SMOL_TOKEN, 1040, 1024, True).num_slots == 100


def test_engine_config_fields():
    assert EngineConfig().max_model_len is None and EngineConfig().gpu_memory_utilization == 0.9
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)


def test_max_model_len_defaults_to_the_models_positions(caplog):
    smol = ModelConfig.from_dir(resolve_model("smollm2-135m"))
    assert smol.max_position_embeddings == 8192
    assert smol.max_len(None) == 8192 and smol.max_len(2048) == 2048
    with caplog.at_level(logging.WARNING, logger="workers.models.config"):
        assert smol.max_len(100_000) == 8192  # capped, as README says, and told
    assert "max_model_len 100000 is capped to the model's max_position_embeddings, 8192" in (
        caplog.text
    )


def test_the_flag_reaches_engine_config(tmp_path):
    parse = build_parser("eagleserve").parse_args
    args = parse(["generate", "in.jsonl", "-o", "out.jsonl", "--gpu-memory-utilization", "0.5"])
    cfg = _engine_config(args)
    assert cfg.gpu_memory_utilization == 0.5 and cfg.max_model_len is None
    assert _engine_config(parse(["generate", "in.jsonl", "-o", "o"])).gpu_memory_utilization == 0.9
    config = tmp_path / "serve.yaml"
    config.write_text("engine: {gpu_memory_utilization: 0.6}\n")
    serve = _serve_config(parse(["serve", "--config", str(config)]))
    assert serve.engine.gpu_memory_utilization == 0.6  # unset flag: the file's value
    flags = ["serve", "--config", str(config), "--gpu-memory-utilization", "0.7"]
    assert _serve_config(parse(flags)).engine.gpu_memory_utilization == 0.7
    assert parse(["bench", "--gpu-memory-utilization", "0.8"]).gpu_memory_utilization == 0.8
    # vLLM's names: --max-num-seqs for --max-batch-size, and the step budget
    sized = ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]
    cfg = _engine_config(parse(["generate", "in.jsonl", "-o", "o", *sized]))
    assert (cfg.max_batch_size, cfg.max_num_batched_tokens) == (64, 2048)
    assert _engine_config(parse(["generate", "in.jsonl", "-o", "o"])).max_batch_size is None
    engine = _serve_config(parse(["serve", "--config", str(config), *sized])).engine
    assert (engine.max_batch_size, engine.max_num_batched_tokens) == (64, 2048)
    assert parse(["bench", "--max-num-batched-tokens", "512"]).max_num_batched_tokens == 512


def test_full_length_gb_holds_every_slot(tiny_dir):
    """What the drafter training's engines ask for: every slot at full length, no less."""
    cfg = ModelConfig.from_dir(tiny_dir)
    gb = full_length_gb(cfg, 3, 100, torch.float32)
    engine = tiny_engine(tiny_dir, max_batch_size=3, max_model_len=100, kv_cache_memory_gb=gb)
    kv = engine.executor.kv
    assert kv.num_blocks == 3 * kv.max_blocks + 1 and kv.sized_by == f"kv_cache_memory_gb={gb}"


def test_size_pool_on_the_gpu_path(tiny_dir, tiny_drafter_dir, monkeypatch):
    """The CUDA branch over fake measurements: the pool gets what utilization leaves, the rule is
    named, and too little memory fails naming it."""
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, max_batch_size=4, max_model_len=100)
    runner = engine.executor
    cache_len, per_block = runner.kv.cache_len, runner.kv.bytes_per_token * 16
    card = dict(total=1000 * per_block, free_at_start=1000 * per_block, graphs=10 * per_block)
    measured = gpu(**card, engine=20 * per_block, peak_step=70 * per_block)
    monkeypatch.setattr(memory_profile, "measure_gpu", lambda *args: measured)
    size = memory_profile.size_pool(runner, cache_len, at_start=(1, 1))
    assert (size.num_slots, size.num_blocks) == (4, 900 - 100)
    assert size.rule == "gpu_memory_utilization=0.9"
    # 5 blocks left, fewer than the 7 of one request at max_model_len
    measured = gpu(**card, engine=20 * per_block, peak_step=865 * per_block)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9: .* room for 5 KV cache"):
        memory_profile.size_pool(runner, cache_len, at_start=(1, 1))


def test_derived_slots_are_profiled_then_capped_by_the_pool(tiny_dir, monkeypatch, caplog):
    """Without max_batch_size the GPU is measured with the derived slots (8 on this CPU runner)
    and a pool of 7 one-block requests keeps 7 of them, as the start log says."""
    runner = tiny_engine(tiny_dir, max_batch_size=None, max_model_len=100).executor
    cache_len, per_block = runner.kv.cache_len, runner.kv.bytes_per_token * 16
    profiled = []

    def measure(runner, cache_len, num_slots, at_start):
        profiled.append(num_slots)
        total = 1000 * per_block
        return gpu(total=total, free_at_start=total, engine=0, peak_step=893 * per_block, graphs=0)

    monkeypatch.setattr(memory_profile, "measure_gpu", measure)
    with caplog.at_level(logging.INFO, logger="workers.memory_profile"):
        size = memory_profile.size_pool(runner, cache_len, at_start=(1, 1))
    assert profiled == [8] and (size.num_slots, size.num_blocks) == (7, 7)
    assert "max_batch_size not set: 7 request slots (at most 8 on CPU" in caplog.text


def test_peak_prefills_cover_many_short_rows_and_the_longest_gathers():
    """The budget over every slot (the paged kernel's rows when slots are many), and over as
    many rows as each gather their context (more than 128 tokens a row) where long rows gather;
    with the prefill kernel, over one row."""
    assert memory_profile.peak_prefill_rows(256, 4096, True) == [31, 256]
    assert memory_profile.peak_prefill_rows(8, 4096, True) == [8]
    assert memory_profile.peak_prefill_rows(4, 64, True) == [1, 4]
    assert memory_profile.peak_prefill_rows(256, 4096, False) == [1, 256]
    assert memory_profile.peak_prefill_rows(8, 4096, False) == [1, 8]


@pytest.mark.parametrize(
    "drafter, siblings, slots, budget, max_len",
    [
        (True, 0, 4, 64, 100),
        (True, 1, 4, 64, 100),
        (False, 0, 4, 64, 100),
        (True, 0, 32, 4096, 300),
    ],
)
def test_peak_steps_run_the_largest_shapes(
    tiny_dir, tiny_drafter_dir, drafter, siblings, slots, budget, max_len
):
    """Every slot prefills its share of the token budget at the end of its context, so do as
    many rows as each take more than the paged kernel's 128 tokens, then every slot verifies
    over the whole cache, through the eager paths, on any device."""
    engine = tiny_engine(
        tiny_dir,
        tiny_drafter_dir if drafter else "none",
        max_batch_size=slots,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
        draft_siblings=siblings,
    )
    runner = engine.executor
    shapes, batch = [], runner.kv.batch

    def recording(slots, positions, valid, kv_len, *args, **kw):
        shapes.append((*positions.shape, kv_len))
        return batch(slots, positions, valid, kv_len, *args, **kw)

    runner.kv.batch = recording
    memory_profile.run_peak_steps(runner, runner.kv.cache_len)
    for num_rows in memory_profile.peak_prefill_rows(slots, budget, gathers_long_rows=True):
        length = min(budget // num_rows, max_len - 1)  # read up to max_model_len
        assert (num_rows, length, max_len) in shapes
    assert (slots, runner.T, runner.kv.cache_len) in shapes  # the verify pass of every slot
    assert runner.resources.is_allocated == [True] * slots
    assert runner.state.output_counts is not None and runner.state.grammar_mask is not None


def test_default_engine_on_smollm2_answers(caplog):
    """No max_model_len, no pool size: the model's 8192 positions, the CPU default pool, and an
    answer."""
    from speculative.engine.llm_engine import LLMEngine, encode_prompt

    with caplog.at_level(logging.INFO, logger="workers.model_runner"):
        engine = LLMEngine(EngineConfig(device="cpu"))
    runner = engine.executor
    assert runner.max_model_len == engine.scheduler.max_model_len == 8192
    assert (runner.num_slots, runner.num_blocks) == (8, 1409)
    line = next(r.getMessage() for r in caplog.records if "bytes per token" in r.getMessage())
    assert "1409 blocks of 16 = 22544 tokens of KV fit" in line
    assert "sized by the CPU default" in line and "2.75 requests at max_model_len 8192" in line
    prompt = encode_prompt(engine.tokenizer, "What is the capital of France?")
    [request] = engine.generate([prompt], SamplingParams(max_tokens=12))
    assert "Paris" in engine.tokenizer.decode(request.output_ids)
