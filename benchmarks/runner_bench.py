"""What the benchmarks that drive one ModelRunner by hand-built plans (no scheduler) share:
random-weight shapes as the published config.json files give them, a runner whose weights are
drawn on its device in its dtype, rows prefilled and placed at a chosen context, and a timer
(CUDA events on a GPU, the wall clock on a CPU, so a CPU dry run goes through the same code).

Used by benchmarks/step_floor.py and benchmarks/families_gpu.py."""

import contextlib
import gc
import time

import torch

import workers.build
from speculative.config import EngineConfig, SamplingParams
from speculative.plan import PrefillRow, StepPlan
from workers.cuda_graphs import capture_step_graphs
from workers.device import pick_device, pick_dtype
from workers.model_runner import ModelRunner
from workers.models import ModelConfig
from workers.models.loader import RANDOM_SHAPES, resolve_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
# `random:<name>` shapes, each as its Hugging Face config.json has it (workers.models.loader's own
# `random:llama-3.1-8b` stops at 8192 positions: too few for a 32k context)
SHAPES = {
    "hf-llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    "hf-qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "use_sliding_window": False, "tie_word_embeddings": False,
    },
    "hf-qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    "hf-qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "hf-gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "swiglu_limit": 7.0, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "rope_theta": 150000.0,
    },
}  # fmt: skip
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096}  # fmt: skip
# CPU dry runs: each family's layer at a few thousand parameters
SHAPES |= {
    "tiny-llama": SHAPES["hf-llama-3.1-8b"] | TINY,
    "tiny-qwen2": SHAPES["hf-qwen2.5-7b"] | TINY,
    "tiny-qwen3": SHAPES["hf-qwen3-8b"] | TINY | {"head_dim": 32},
    "tiny-qwen3-moe": SHAPES["hf-qwen3-30b-a3b"]
    | TINY
    | {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "tiny-gpt-oss": SHAPES["hf-gpt-oss-20b"]
    | TINY
    | {"head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 16}
    | {"layer_types": ["sliding_attention", "full_attention"] * 2},
}


def register_shapes() -> None:
    """Make `random:<name>` of every shape above known to the loader (the benchmark's own
    presets: workers/ keeps its one)."""
    for name, shape in SHAPES.items():
        RANDOM_SHAPES.setdefault(name, shape)


def model_config(model: str) -> ModelConfig:
    """A model's checked config (a random shape, a directory or a GGUF file)."""
    return ModelConfig.from_dir(resolve_model(model))


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, drafter: bool) -> int:
    """The target's K and V of one token, plus one drafter layer's (a head shaped like a layer)."""
    layers = cfg.num_hidden_layers + int(drafter)
    return 2 * layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def draft_vocab(size: int | None):
    """The `random` drafter with a draft vocabulary of `size` tokens (the published EAGLE-3
    heads of yuhuili: 32000) instead of the target's whole vocabulary."""
    original = workers.build.drafter_config_for
    if size:
        workers.build.drafter_config_for = lambda cfg: original(cfg, draft_vocab_size=size)
    try:
        yield
    finally:
        workers.build.drafter_config_for = original


def build_runner(cfg: EngineConfig, graphs: bool, draft_vocab_size: int | None = None):
    """cfg's runner, its random weights drawn on the device in the run's dtype (no float32 copy
    first: an 8B target takes 16 GB, not 48 at its peak) and, on a GPU with `graphs`, the
    engine's CUDA graphs captured as ModelRunner captures them. Seeded: runners of one model and
    dtype draw the same target weights, with a drafter or without."""
    dtype = pick_dtype(cfg.dtype, pick_device(cfg.device))
    torch.manual_seed(0)
    with default_dtype(dtype), draft_vocab(draft_vocab_size):
        runner = ModelRunner(cfg.model_copy(update={"cuda_graphs": False}))
    if graphs and runner.device.type == "cuda":
        with torch.inference_mode():
            runner.graphs = capture_step_graphs(runner)
    return runner


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def place_rows(runner: ModelRunner, batch: int, num_tokens: int) -> None:
    """Slots 0..batch-1 each own num_tokens rows of KV in blocks of their own (hand-built plans
    carry no block updates, and the pool may be smaller than every slot at full length)."""
    kv = runner.kv
    n = -(-num_tokens // kv.block_size)
    if batch * n > kv.num_blocks or n > kv.max_blocks:
        raise ValueError(f"{batch} rows of {num_tokens} tokens do not fit the KV pool")
    blocks = torch.arange(batch * n, device=kv.block_table.device).view(batch, n)
    kv.block_table[:batch] = kv.dummy_block
    kv.block_table[:batch, :n] = blocks


def prefill(runner: ModelRunner, batch: int, prompt_len: int, vocab: int) -> list[int]:
    """Admit slots 0..batch-1 with prompts of prompt_len pseudo-random tokens (greedy)."""
    rows = [
        PrefillRow(s, [1 + (s * 7919 + i * 104729) % (vocab - 1) for i in range(prompt_len)],
                   s, SamplingParams())
        for s in range(batch)
    ]  # fmt: skip
    plan = StepPlan(step_id=0, prefills=rows, kv_len=-(-prompt_len // 64) * 64)
    runner.execute(plan).result()
    return list(range(batch))


def release(runner: ModelRunner, slots: list[int]) -> None:
    for slot in slots:
        runner.resources.free(slot)


def rewind(runner: ModelRunner, batch: int, position: int) -> None:
    """Every timed step starts its rows at `position`, so steps stay inside the context."""
    runner.state.num_computed[:batch] = position


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Milliseconds per call of fn, calls back to back (the host runs ahead where it can)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) * 1000 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def margin(k: int, repeats: int, warmup: int = 3) -> int:
    """KV rows past the start that a timed run of verify steps may write (K+1 a step at most)."""
    return (k + 1) * (warmup + repeats + 2) + 2 * k + 1


@torch.inference_mode()
def time_decode(runner: ModelRunner, batch: int, context: int, repeats: int) -> dict:
    """The engine's decode step (verify pass and drafts, or plain decoding) over batch rows that
    read `context` KV rows each: ms per step back to back, and the host's ms to launch one."""
    place_rows(runner, batch, context)
    slots = prefill(runner, batch, 16, runner.target_cfg.vocab_size)
    start = context - margin(runner.K, repeats)
    plan = StepPlan(step_id=1, decode_slots=slots, kv_len=context)
    host_s = []

    def step():
        host_s.append(runner.execute(plan).execute_s)

    rewind(runner, batch, start)
    step_ms = time_ms(step, runner.device, repeats)
    release(runner, slots)
    return {"step_ms": step_ms, "host_ms": 1000 * sum(host_s[-repeats:]) / repeats}


def progress(items: list, what: str, unit: str):
    from tqdm import tqdm

    return tqdm(items, desc=what, unit=unit)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
