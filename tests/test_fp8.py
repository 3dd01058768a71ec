"""FP8 checkpoints and `quantization: fp8` on CPU (prefill's fallback matmul quantizes the
activations as the GPU's `torch._scaled_mm` path does; a step's few rows are weight-only):
every other quantization_config refused by name before any weight is read; each FP8 layout
held to its dequantized twin run by transformers within FP8 tolerance; FP8 layers sharded for TP
reassembling to the unsharded result; speculative greedy equal to plain greedy with an FP8
target."""

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import run_to_completion, tiny_engine, tiny_prompts, write_random_drafter
from conftest import write_tiny_llama as write_llama
from tiny_families import write_tiny_family
from tiny_fp8 import dequantized_twin, quantization_config, write_fp8
from tiny_models import attach_kv, prefill_batch
from torch.testing._internal.distributed.fake_pg import FakeStore

from speculative.config import EngineConfig, SamplingParams
from workers.build import load_models, weight_bytes
from workers.layers.fp8 import FP8, fp8_linear, quantize_rows
from workers.layers.parallel import ColumnParallelLinear, RowParallelLinear
from workers.models import ModelConfig

LAYOUTS = ["fp8-tensor", "ct-channel", "ct-tensor"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
CT_INT8 = quantization_config("ct-channel") | {"format": "int-quantized"}
CT_W8A16 = quantization_config("ct-channel")
CT_W8A16["config_groups"]["group_0"]["input_activations"] = None
REFUSED = [  # (quantization_config, words the error must contain)
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": False}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "weight_block_size",
    ),  # fmt: skip
    (CT_INT8, "format 'int-quantized'"),
    (CT_W8A16, "input_activations None"),
]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    """Weights narrow enough (std 0.05) that FP8's rounding moves the logits by about 1%."""
    return write_llama(tmp_path_factory.mktemp("fp8") / "float", std=0.05)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """The conftest's wide weights: greedy choices far from ties, for the exactness tests."""
    return write_llama(tmp_path_factory.mktemp("fp8") / "wide")


def target_logits(model_dir, prompts, **overrides) -> torch.Tensor:
    """Our target's logits at every prompt position, each prompt alone: [tokens, vocab]."""
    cfg = EngineConfig(model=str(model_dir), drafter="none", device="cpu", dtype="float32")
    cfg = cfg.model_copy(update=overrides)
    model_cfg = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    target, _ = load_models(cfg, model_cfg, model_dir, None, cpu, torch.float32, 256)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            kv = attach_kv(target, 1, 256)
            positions = torch.arange(len(prompt)).unsqueeze(0)
            hidden, _ = target(torch.tensor([prompt]), prefill_batch(kv, [0], positions, 256))
            out.append(target.logits(hidden)[0])
    return torch.cat(out), target


def hf_logits(model_dir, prompts) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])


def assert_fp8_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Within FP8 tolerance: logits within 4% of their range, the top-1 choice at 95% or more
    of the positions (the misses are near-ties of the reference)."""
    error = (ours - reference).abs().max() / reference.abs().max()
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean()
    assert error < 0.04 and agree >= 0.95, f"relative error {error:.3f}, top-1 agreement {agree}"


@pytest.mark.parametrize("config, named", REFUSED)
def test_other_quantization_refused_by_name(tmp_path, float_dir, config, named):
    """At the config, before any weight: a checkpoint whose safetensors file is garbage still
    gets the quantization error, naming the method and what loads."""
    model = tmp_path / "quantized"
    shutil.copytree(float_dir, model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    config_json = json.loads((model / "config.json").read_text())
    config_json["quantization_config"] = config
    (model / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ValueError, match=named) as refused:
        tiny_engine(model)
    assert "supported: 'fp8' with activation_scheme 'dynamic'" in str(refused.value)
    assert "compressed-tensors' FP8_DYNAMIC" in str(refused.value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_layouts_match_their_dequantized_twin(tmp_path, float_dir, layout):
    """Each layout loads as FP8 (half the bytes of the linear layers' bfloat16, all of them
    FP8), and its logits are transformers' on the dequantized checkpoint, within FP8
    tolerance."""
    fp8_dir = write_fp8(float_dir, tmp_path / layout, layout)
    prompts = tiny_prompts(4, seed=1, min_len=10, max_len=40)
    ours, target = target_logits(fp8_dir, prompts)
    linears = [m for n, m in target.named_modules() if n.endswith(("_proj", "qkv_proj"))]
    assert len(linears) == 4 * 4 and all(m.weight.dtype == FP8 for m in linears)
    assert target.cfg.quantization == quantization_config(layout)["quant_method"]
    reference = hf_logits(dequantized_twin(fp8_dir, tmp_path / "twin"), prompts)
    assert_fp8_close(ours, reference)
    _, float_target = target_logits(float_dir, prompts[:1])
    # a byte an element, not four, and a float32 scale a row
    saved = sum(3 * m.weight.numel() - 4 * m.weight.shape[0] for m in linears)
    assert weight_bytes(target) == weight_bytes(float_target) - saved


def test_qwen2_biases_and_qwen3_norms_in_fp8(tmp_path):
    """The families' extras around FP8 projections: Qwen2's q/k/v biases (added after the FP8
    matmul) and Qwen3's per-head norms, each against its dequantized twin."""
    prompts = tiny_prompts(3, vocab=96, seed=2, min_len=10, max_len=30)
    for family in ("qwen2", "qwen3"):
        src = write_tiny_family(tmp_path / family, family, std=0.05)
        fp8_dir = write_fp8(src, tmp_path / f"{family}-fp8", "ct-channel")
        ours, _ = target_logits(fp8_dir, prompts)
        twin = dequantized_twin(fp8_dir, tmp_path / f"{family}-twin")
        assert_fp8_close(ours, hf_logits(twin, prompts))


def test_quantization_fp8_quantizes_a_float_checkpoint(float_dir):
    """`quantization: fp8` on a float checkpoint: every linear layer FP8 with a scale per row
    (the row's maximum maps to 448), the logits the float model's within FP8 tolerance."""
    prompts = tiny_prompts(4, seed=3, min_len=10, max_len=40)
    ours, target = target_logits(float_dir, prompts, quantization="fp8")
    reference, float_target = target_logits(float_dir, prompts)
    assert_fp8_close(ours, reference)
    down = target.layers[0].mlp.down_proj
    float_down = float_target.layers[0].mlp.down_proj.weight
    assert down.weight.dtype == FP8 and down.weight_scale.shape == (float_down.shape[0],)
    torch.testing.assert_close(down.weight_scale * 448, float_down.abs().amax(dim=1))
    assert target.lm_head.weight.dtype == torch.float32  # the LM head and embeddings stay


def test_fp8_matmul_quantizes_activations_per_token(monkeypatch):
    """The fallback matmul (prefill's rows; here every size): each token's activations to its
    own scale (a row of zeros stays zero), the weights' per-row scales after the product."""
    monkeypatch.setenv("EAGLESERVE_FP8_WEIGHT_ONLY", "0")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g) * torch.tensor([1.0, 100.0, 0.01, 0.0, 3.0])[:, None]
    w = torch.randn(48, 64, generator=g) * 0.1
    w8, scale = quantize_rows(w)
    out = fp8_linear(x, w8, scale)
    exact = x @ w.t()
    assert out[3].abs().max() == 0
    for row in (0, 1, 2, 4):  # each token's error relative to its own size
        assert (out[row] - exact[row]).abs().max() < 0.06 * exact[row].abs().max()


def shard(layer_class, rank: int, *args):
    """The layer as rank `rank` of 2 builds it, over PyTorch's fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        return layer_class(*args, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_sharded_fp8_layers_reassemble_to_the_unsharded_result():
    """TP=2: a fused q/k/v column-parallel layer with one scale per sub-matrix (per-tensor) and
    a row-parallel layer with per-channel scales. Column shards' outputs, put back in order,
    are the unsharded layer's exactly; row shards' partial sums add up to it (each rank
    quantizes its own slice of the activations, as vLLM's do)."""
    g = torch.Generator().manual_seed(4)
    sizes, hidden = [64, 32, 32], 64
    parts = [torch.randn(n, hidden, generator=g).to(FP8) for n in sizes]
    part_scales = [torch.tensor(s) for s in (0.01, 0.02, 0.03)]
    down = torch.randn(hidden, 128, generator=g).to(FP8)
    down_scale = torch.rand(hidden, 1, generator=g) / 100
    x, h = torch.randn(3, hidden, generator=g), torch.randn(3, 128, generator=g)

    def loaded(layer):
        layer.use_fp8(quantize=False)
        if isinstance(layer, ColumnParallelLinear):
            for i, (w, s) in enumerate(zip(parts, part_scales)):
                layer.load_full(w.float(), i, "weight")
                layer.load_full(s, i, "weight_scale")
        else:
            layer.load_full(down.float(), 0, "weight")
            layer.load_full(down_scale, 0, "weight_scale")
        return layer

    whole_qkv = loaded(ColumnParallelLinear(hidden, sizes))
    whole_down = loaded(RowParallelLinear(128, hidden))
    qkv = [loaded(shard(ColumnParallelLinear, r, hidden, sizes)) for r in (0, 1)]
    downs = [loaded(shard(RowParallelLinear, r, 128, hidden)) for r in (0, 1)]
    outs = [layer(x).split([n // 2 for n in sizes], dim=-1) for layer in qkv]
    reassembled = torch.cat([torch.cat([o[i] for o in outs], -1) for i in range(3)], -1)
    torch.testing.assert_close(reassembled, whole_qkv(x), rtol=0, atol=0)
    assert all(torch.equal(d.weight_scale, whole_down.weight_scale) for d in downs)
    partial = sum(d(h[:, 64 * r : 64 * (r + 1)]) for r, d in enumerate(downs))
    exact = h @ (down.float() * down_scale).t()
    for out in (partial, whole_down(h)):
        assert (out - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("layout", ["ct-channel", "online"])
def test_speculative_greedy_equals_plain_with_an_fp8_target(tmp_path, wide_dir, layout):
    """Requests joining mid-flight, a random drafter (in float32, as the drafter always stays)
    over an FP8 target: the tokens of plain greedy decoding of the same FP8 target."""
    if layout == "online":
        model, options = wide_dir, {"quantization": "fp8"}
    else:
        model, options = write_fp8(wide_dir, tmp_path / layout, layout), {}
    drafter = write_random_drafter(tmp_path / "drafter", wide_dir)
    # FP8 rounds every layer's activations, so float noise between batch shapes can move a
    # logit by about 1% (float32: 1e-6); these prompts' greedy choices have no such near-tie
    # (seed 5's fourth prompt has one, 0.03 apart, where plain decoding itself changes its
    # choice with the batch's shape)
    prompts = tiny_prompts(5, seed=6)
    plain = run_to_completion(tiny_engine(model, **options), prompts, GREEDY, [0, 0, 1, 3, 6])
    engine = tiny_engine(model, drafter, k=3, max_batch_size=3, **options)
    drafted = run_to_completion(engine, prompts, GREEDY, [0, 0, 1, 3, 6])
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    assert engine.executor.drafter.fc.weight.dtype == torch.float32
    assert engine.executor.target.layers[0].mlp.down_proj.weight.dtype == FP8


def test_fp8_kv_cache_speculative_equals_plain(tmp_path, wide_dir):
    """kv_cache_dtype fp8 over an FP8 checkpoint with per-layer K and V scales (its
    kv_cache_scheme): the pool in E4M3 at the checkpoint's scales, and speculative greedy
    tokens equal plain greedy ones."""
    model = write_fp8(wide_dir, tmp_path / "kv", "ct-channel", kv_scales=True)
    drafter = write_random_drafter(tmp_path / "drafter", wide_dir)
    prompts = tiny_prompts(5, seed=6)
    joins = [0, 0, 1, 3, 6]
    plain_engine = tiny_engine(model, kv_cache_dtype="fp8")
    plain = run_to_completion(plain_engine, prompts, GREEDY, joins)
    engine = tiny_engine(model, drafter, k=3, max_batch_size=3, kv_cache_dtype="fp8")
    drafted = run_to_completion(engine, prompts, GREEDY, joins)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    kv = engine.executor.kv
    assert kv.target.dtype == FP8 and kv.drafter.dtype == FP8
    scales = [layer.self_attn.kv_scale for layer in engine.executor.target.layers]
    assert scales == [pytest.approx([0.05 + 0.01 * i, 0.02 + 0.01 * i]) for i in range(4)]


def test_fp8_kv_cache_holds_a_quarter_of_float32s_bytes_a_token(float_dir, caplog):
    """The same kv_cache_memory_gb holds 4x float32's tokens (2x bfloat16's): one byte an
    element, as the start log says."""
    engines = {
        dtype: tiny_engine(float_dir, kv_cache_memory_gb=0.001, kv_cache_dtype=dtype)
        for dtype in ("auto", "fp8")
    }
    auto, fp8 = (engines[d].executor.kv for d in ("auto", "fp8"))
    assert fp8.bytes_per_token == 4 * 2 * 2 * 16 == auto.bytes_per_token // 4
    assert 4 * auto.num_blocks <= fp8.num_blocks < 4 * (auto.num_blocks + 1)  # whole blocks
    with caplog.at_level("INFO", logger="workers.model_runner"):
        tiny_engine(float_dir, kv_cache_memory_gb=0.001, kv_cache_dtype="fp8")
    assert any("KV cache 256 bytes per token" in r.getMessage() for r in caplog.records)
