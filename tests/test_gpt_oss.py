"""gpt-oss as transformers builds and saves it (GptOssForCausalLM: attention sinks, a sliding
window shorter than the prompts in every other layer, biased router and experts with the clamped
SwiGLU, YaRN): prompt log-probabilities and greedy output equal to transformers'; the published
MXFP4 layout dequantized at load to the same model; speculative greedy equal to plain, chain and
draft tree, in bfloat16 and with FP8 experts; the fused kernel with biases and the clamp equal
to the loop under Triton's interpreter. TP 2 is in test_models_tp.py."""

import json
import os
import shutil

import pytest
import torch
from conftest import replay_graphs_on_cpu, run_to_completion, tiny_engine, tiny_prompts
from safetensors.torch import load_file, save_file
from tiny_families import assert_greedy_equal, hf_greedy, write_flat_head, write_tiny_family

from speculative.config import SamplingParams
from workers.layers.attention import attention_with_sinks
from workers.layers.moe import moe_reference, route
from workers.models.gpt_oss import GptOss
from workers.models.quantization import FP4_VALUES, dequantize_mxfp4

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_family(tmp_path_factory.mktemp("gpt_oss") / "float", "gpt_oss")


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(3, vocab=96, seed=3, min_len=12, max_len=60)  # all past the window of 8


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def assert_matches_transformers(engine, reference_dir, prompts) -> None:
    params = GREEDY.model_copy(update={"prompt_logprobs": 1})
    for prompt, request in zip(prompts, run_to_completion(engine, prompts, params)):
        ours = torch.tensor([chosen for chosen, _ in request.prompt_logprobs])
        expected = hf_prompt_logprobs(reference_dir, prompt)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
        assert_greedy_equal(request.output_ids, *hf_greedy(reference_dir, prompt, 16))


def test_logprobs_and_greedy_match_transformers(model_dir, prompts):
    engine = tiny_engine(model_dir)
    target, cfg = engine.executor.target, engine.executor.target_cfg
    assert type(target) is GptOss and cfg.sliding_layers == (0, 2) and cfg.sliding_window == 8
    windows = [layer.self_attn.sliding_window for layer in target.layers]
    assert windows == [8, None, 8, None] and target.layers[0].mlp.experts.limit == 1.5
    assert_matches_transformers(engine, model_dir, prompts)


def test_sinks_take_their_share_of_the_softmax():
    """Against the formula transformers' eager attention spells out: the sink is one more logit
    in each head's softmax, whose probability is dropped."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))  # KV 2, T 3 x group 2
    sinks, bias = torch.randn(4, generator=g), torch.zeros(2, 1, 6, 6)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    sink = sinks.view(2, 1, 2).expand(2, 3, 2).reshape(1, 2, 6, 1).expand(2, 2, 6, 1)
    expected = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
    torch.testing.assert_close(attention_with_sinks(q, k, v, bias, sinks), expected)
    plain = torch.softmax(scores, -1) @ v
    assert (attention_with_sinks(q, k, v, bias, sinks).norm() < plain.norm()).item()


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, in] -> (blocks [..., rows, in / 32, 16] uint8, scales [..., rows, in / 32]):
    each run of 32 scaled by a power of two that fits its largest value in 6, then each value
    rounded to the nearest E2M1 code, two codes a byte, the low nibble first."""
    runs = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(runs.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = runs / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_dirs(model_dir, tmp_path_factory):
    """(the published MXFP4 layout, the same weights dequantized in transformers' layout)."""
    root = tmp_path_factory.mktemp("mxfp4")
    packed, plain = root / "mxfp4", root / "dequantized"
    shutil.copytree(model_dir, packed)
    shutil.copytree(model_dir, plain)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors.pop(name).transpose(1, 2))  # rows: outputs
        tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
    save_file(tensors, str(packed / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))
    for name in [n for n in tensors if n.endswith("_blocks")]:
        weight = dequantize_mxfp4(tensors.pop(name), tensors.pop(name[:-7] + "_scales"))
        tensors[name[:-7]] = weight.transpose(1, 2).contiguous()
    save_file(tensors, str(plain / "model.safetensors"))
    return packed, plain


def test_mxfp4_checkpoint_is_its_dequantized_model(mxfp4_dirs, prompts):
    packed, plain = mxfp4_dirs
    engine = tiny_engine(packed)
    assert_matches_transformers(engine, plain, prompts[:2])
    codes = load_file(str(packed / "model.safetensors"))[
        "model.layers.1.mlp.experts.down_proj_blocks"
    ]
    assert len(torch.unique(codes)) > 100  # real codes, not a constant


def test_a_lone_mxfp4_half_is_named():
    blocks = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    tensors = [("model.layers.0.mlp.experts.down_proj_blocks", blocks)]
    with pytest.raises(ValueError, match="without their blocks or scales"):
        list(GptOss.checkpoint_tensors(tensors))


@pytest.mark.parametrize(
    "head, dtype, quantization, siblings",
    [("flat", "bfloat16", None, 0), ("flat", "float32", "fp8", 1), ("ngram", "float32", None, 0)],
)
def test_speculative_greedy_equals_plain(
    model_dir, prompts, tmp_path, head, dtype, quantization, siblings
):
    """A head in the published flat layout in bfloat16, then with FP8 experts and a draft tree
    (whose nodes the window and sinks see as the chain's do); n-gram drafts, which the random
    model's looping output accepts; steps replayed as graphs (the CPU stand-in)."""
    drafter = write_flat_head(tmp_path / "drafter", model_dir) if head == "flat" else head
    options = dict(dtype=dtype, quantization=quantization)
    long = GREEDY.model_copy(update={"max_tokens": 40})
    plain = run_to_completion(tiny_engine(model_dir, **options), prompts, long)
    engine = tiny_engine(model_dir, drafter, k=3, draft_siblings=siblings, **options)
    graphs = replay_graphs_on_cpu(engine.executor)
    drafted = run_to_completion(engine, prompts, long)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    assert sum(g.replays for g in graphs.all()) > 0
    if head == "ngram":
        assert engine.scheduler.stats.num_draft_accepted > 10


@pytest.mark.parametrize("dtype, fp8", [(torch.float32, False), (torch.float32, True)])
def test_fused_kernel_with_biases_and_clamp_equals_the_loop(dtype, fp8):
    pytest.importorskip("triton")
    from workers.layers.fp8 import quantize_rows
    from workers.layers.fused_moe import fused_moe

    E, k, T, H, inter = 6, 2, 9, 64, 40
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) / 4, torch.randn(E, H, inter, generator=g)
    scales = (None, None)
    if fp8:
        (w13, s13), (w2, s2) = (
            quantize_rows(w13.reshape(-1, H)),
            quantize_rows(w2.reshape(-1, inter)),
        )
        w13, w2, scales = (
            w13.view(E, 2 * inter, H),
            w2.view(E, H, inter),
            (s13.view(E, -1), s2.view(E, -1)),
        )
    b13 = torch.randn(E, 2 * inter, generator=g)
    x = torch.randn(T, H, generator=g).to(dtype)
    weights, ids = route(torch.randn(T, E, generator=g), k, renormalize=True)
    args = (x, w13, w2, weights, ids, *scales, b13, 1.5)
    reference = moe_reference(*args)
    torch.testing.assert_close(fused_moe(*args), reference, atol=1e-4, rtol=1e-4)
    unclamped = moe_reference(x, w13, w2, weights, ids, *scales, b13, None)
    assert not torch.allclose(reference, unclamped)  # the clamp bites at these sizes


@pytest.mark.parametrize(
    "kernel, T, tree, num_splits",
    [("decode", 1, None, 1), ("decode", 4, None, 3), ("decode", 7, (3, 1), 2),
     ("prefill", 40, None, 1), ("prefill", 40, None, 3)],
)  # fmt: skip
def test_kernels_with_window_and_sinks_match_the_reference(kernel, T, tree, num_splits):
    """The Triton kernels under the interpreter: rows far longer than the window (most key tiles
    skipped), the verify pass and a draft tree, keys split across programs (the sinks join in
    the combine)."""
    pytest.importorskip("triton")
    from paged_batches import random_batch, reference

    from speculative.draft_tree import tree_layout
    from workers.layers.paged_attention import paged_attention
    from workers.layers.paged_prefill import paged_prefill

    g = torch.Generator().manual_seed(T * 10 + num_splits)
    layout = None if tree is None else tree_layout(*tree)
    q, pool, batch = random_batch(g, 3, T, 8, 2, 32, 16, tree=layout, max_blocks=12)
    sinks = torch.randn(8, generator=g) * 2
    run = paged_attention if kernel == "decode" else paged_prefill
    out = run(q, pool, batch, num_splits=num_splits, window=20, sinks=sinks)
    torch.testing.assert_close(out, reference(q, pool, batch, window=20, sinks=sinks))
    plain = run(q, pool, batch, num_splits=num_splits)
    assert not torch.allclose(out, plain)  # the window and the sinks change the result


def test_engine_with_the_kernels_gives_the_gather_paths_tokens(model_dir, monkeypatch):
    """The GPU's attention path (decode kernel for short rows, prefill kernel past
    KERNEL_MAX_QUERY) through the engine, window and sinks passed by every layer, against the
    gather path's tokens; speculative, so the verify pass runs the kernel too."""
    pytest.importorskip("triton")
    import workers.layers.paged_prefill
    from workers.layers import attention_backend

    calls = []

    def counted_prefill(q, pool, batch, kv_scale, window, sinks):
        calls.append((window, sinks is not None))
        return paged_prefill(q, pool, batch, kv_scale, window, sinks)

    paged_prefill = workers.layers.paged_prefill.paged_prefill
    monkeypatch.setattr(workers.layers.paged_prefill, "paged_prefill", counted_prefill)
    monkeypatch.setattr(attention_backend, "KERNEL_MAX_QUERY", 8)
    prompts = tiny_prompts(2, vocab=96, seed=5, min_len=20, max_len=30)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = []
    for kernel in (False, True):
        monkeypatch.setattr(attention_backend, "use_paged_kernel", lambda d, t, use=kernel: use)
        engine = tiny_engine(model_dir, "ngram", k=2)
        outputs.append([r.output_ids for r in run_to_completion(engine, prompts, params)])
    assert outputs[0] == outputs[1]
    assert {(8, True), (None, True)} <= set(calls)
