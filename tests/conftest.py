"""Shared fixtures: tiny random-weight Llama targets written as Hugging Face directories, random
EAGLE-3 drafters for them, prompts from the benchmark sets shipped in deployments/data, and
session-scoped engines on the real SmolLM2-135M (loaded once for the whole run)."""

import json
import os
from pathlib import Path

import pytest
import torch
from cpu_graphs import CpuStepGraphs, SharedPool
from safetensors.torch import save_file

from deployments.prompt_sets import eagle_set, load_prompts
from workers.cuda_graphs import StepGraphSet, step_graph_set

# A 2-core machine shared with other jobs: OpenMP worker threads spin against each other and make
# small ops 10-100x slower. One intra-op thread is faster here (EAGLESERVE_TEST_THREADS overrides).
torch.set_num_threads(int(os.environ.get("EAGLESERVE_TEST_THREADS", "1")))


# ---- tiny random models ----


def write_tiny_llama(
    path: Path,
    *,
    vocab_size: int = 64,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie: bool = False,
    eos_token_id: int | None = None,
    seed: int = 0,
    std: float = 0.2,
    max_position_embeddings: int = 1024,
) -> Path:
    """A random Llama in the Hugging Face layout (config.json + model.safetensors, HF tensor names).
    Weights depend only on the seed and shapes: two directories differing in eos are one model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    H, I, D = hidden_size, intermediate_size, hidden_size // num_heads

    def w(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    # projections scaled by fan-in so the residual stream stays O(1) and tokens stay well separated
    proj = std * 8 / H**0.5
    tensors = {"model.embed_tokens.weight": w(vocab_size, H, scale=1.0)}
    for n in range(num_layers):
        p = f"model.layers.{n}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(num_heads * D, H, scale=proj),
            p + "self_attn.k_proj.weight": w(num_kv_heads * D, H, scale=proj),
            p + "self_attn.v_proj.weight": w(num_kv_heads * D, H, scale=proj),
            p + "self_attn.o_proj.weight": w(H, num_heads * D, scale=proj),
            p + "mlp.gate_proj.weight": w(I, H, scale=proj),
            p + "mlp.up_proj.weight": w(I, H, scale=proj),
            p + "mlp.down_proj.weight": w(H, I, scale=proj),
            p + "input_layernorm.weight": 1.0 + w(H, scale=0.1),
            p + "post_attention_layernorm.weight": 1.0 + w(H, scale=0.1),
        }
    tensors["model.norm.weight"] = 1.0 + w(H, scale=0.1)
    lm_head = w(vocab_size, H, scale=3.0 / H**0.5)
    if not tie:
        tensors["lm_head.weight"] = lm_head
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie,
        "eos_token_id": eos_token_id,
        "bos_token_id": None,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_random_drafter(
    path: Path,
    target_dir: Path,
    *,
    seed: int = 1,
    std: float = 0.2,
    draft_vocab_size: int | None = None,
) -> Path:
    """A random EAGLE-3 drafter for a target directory, in the standard layout, with weights large
    enough that its greedy drafts are not near-ties (stable argmax across batch shapes)."""
    from speculative.drafter_format import drafter_config_for, random_drafter_state, save_drafter
    from workers.models import ModelConfig

    cfg = drafter_config_for(
        ModelConfig.from_hf(json.loads((Path(target_dir) / "config.json").read_text())),
        draft_vocab_size,
    )
    state = random_drafter_state(cfg, seed=seed)
    state = {
        n: (
            t * (std / 0.02)
            if n.endswith("proj.weight") or n in ("fc.weight", "lm_head.weight")
            else t
        )
        for n, t in state.items()
    }
    save_drafter(path, cfg, state)
    return Path(path)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """vocab 64, 4 layers, untied, no EOS: the workhorse target for fast engine tests."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def tiny_drafter_dir(tmp_path_factory, tiny_dir) -> Path:
    return write_random_drafter(tmp_path_factory.mktemp("tiny") / "drafter", tiny_dir)


def tiny_engine(model_dir, drafter="none", k: int = 3, **overrides):
    from speculative.config import EngineConfig
    from speculative.engine.llm_engine import LLMEngine

    cfg = dict(
        model=str(model_dir),
        drafter=str(drafter),
        num_draft_tokens=k,
        max_batch_size=8,
        max_model_len=256,
        max_num_batched_tokens=1024,
        device="cpu",
        dtype="float32",
    )
    return LLMEngine(EngineConfig(**(cfg | overrides)))


def run_to_completion(engine, prompts, params, join_schedule=None, on_output=None):
    """Add requests (all at once, or `join_schedule[i]` = number of engine steps before request i
    is added) and step until done. on_output(i, output): each RequestOutput a step streams, with
    its request's input index. Returns the requests in input order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    join_schedule = join_schedule or [0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: join_schedule[i])
    requests, index, steps = {}, {}, 0
    while pending or engine.has_work:
        while pending and join_schedule[pending[0]] <= steps:
            i = pending.pop(0)
            requests[i] = engine.add_request(prompts[i], params[i])
            index[requests[i].request_id] = i
        for output in engine.step():
            if on_output is not None:
                on_output(index[output.request_id], output)
        steps += 1
    return [requests[i] for i in range(len(prompts))]


def tiny_prompts(
    n: int, vocab: int = 64, seed: int = 0, min_len: int = 3, max_len: int = 40
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lens]


# ---- the real SmolLM2 ----


def bench_questions(n: int) -> list[str]:
    """n prompts mixing the EAGLE benchmark sets (gsm8k, alpaca, qa: turns[0]) and GSM8K test."""
    per = -(-n // 4)
    out = []
    for name in ("gsm8k", "alpaca", "qa"):
        out += load_prompts(str(eagle_set(name)), per)
    out += load_prompts(None, per)  # GSM8K test
    return out[:n]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from workers.models.loader import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_engine) -> list[list[int]]:
    from speculative.engine.llm_engine import encode_prompt

    return [encode_prompt(smollm2_engine.tokenizer, q) for q in bench_questions(20)]


def _smollm2(drafter: str, **overrides):
    from speculative.config import EngineConfig
    from speculative.engine.llm_engine import LLMEngine

    cfg = dict(
        drafter=drafter,
        max_batch_size=20,
        max_model_len=512,
        max_num_batched_tokens=2048,
        device="cpu",
        dtype="float32",
    )
    return LLMEngine(EngineConfig(**(cfg | overrides)))


@pytest.fixture(scope="session")
def smollm2_engine():
    """Plain decoding on the real SmolLM2 (fp32, CPU), batch up to 20."""
    return _smollm2("none")


@pytest.fixture(scope="session")
def smollm2_greedy_64(smollm2_engine, smollm2_prompts):
    """Plain greedy output ids, 64 new tokens, all 20 prompts run as one batch."""
    from speculative.config import SamplingParams

    requests = smollm2_engine.generate(smollm2_prompts, SamplingParams(max_tokens=64))
    return [r.output_ids for r in requests]


@pytest.fixture(scope="session")
def hf_smollm2():
    """Hugging Face's Llama on the same GGUF file (its own dequantization and q/k un-permute)."""
    from transformers import AutoModelForCausalLM

    from workers.models.loader import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_near_tie(hf_smollm2):
    """check(prompt, ours, reference): equal token for token, or the first difference is a proven
    near-tie: the top-two fp32 logits of HF on the common prefix differ by < 1e-4, and the two
    sequences took those two tokens (a sequence that ended there ended by EOS, a top-two token)."""

    def check(prompt: list[int], ours: list[int], reference: list[int], tol: float = 1e-4) -> None:
        if ours == reference:
            return
        n = next(
            (i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
            min(len(ours), len(reference)),
        )
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([prompt + ours[:n]])).logits[0, -1].float()
        top = logits.topk(2)
        gap = (top.values[0] - top.values[1]).item()
        taken = {seq[n] for seq in (ours, reference) if n < len(seq)}
        assert gap < tol and taken <= set(top.indices.tolist()), (
            f"outputs differ at new token {n}: ours {ours[n : n + 3]}, "
            f"reference {reference[n : n + 3]}; "
            f"top-two logits {top.indices.tolist()} differ by {gap:.2e} (not a near-tie)"
        )

    return check


def replay_graphs_on_cpu(runner, *parts: str, batch_only: bool = True) -> StepGraphSet:
    """The runner's step graphs as CpuStepGraphs (the real bucketing and padding, replayed
    eagerly: tests/cpu_graphs.py), captured: the named parts of the set (prefill, verify,
    target_pass, chain, verify_by_width, draft_depth), or all of them. Returns the runner's set.
    The step graphs are keyed as where the paged kernel runs, by batch bucket only
    (batch_only=False: by length too, as the gather's)."""
    built = step_graph_set(runner, CpuStepGraphs, batch_only)
    every = ("prefill", "verify", "target_pass", "chain", "verify_by_width", "draft_depth")
    chosen = StepGraphSet(**{part: getattr(built, part) for part in parts or every})
    pool = SharedPool()  # captured in the engine's order, into one pool (capture_step_graphs)
    for g in chosen.all():
        g.pool = pool
        g.capture_all()
    for part in parts or every:
        setattr(runner.graphs, part, getattr(chosen, part))
    return runner.graphs
