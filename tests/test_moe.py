"""Mixture-of-experts targets (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with dense
layers between sparse ones), as transformers builds and saves them: prompt log-probabilities and
greedy output equal to transformers', speculative greedy equal to plain in float32, bfloat16 and
FP8; and the fused Triton kernel (run by Triton's interpreter on CPU) equal to the loop over
experts across expert counts, top-k 1 to 8 and uneven routings: experts with no token, one, or
every one. TP 2 and 3 are in test_models_tp.py."""

import os

import pytest
import torch
from conftest import (
    replay_graphs_on_cpu,
    run_to_completion,
    tiny_engine,
    tiny_prompts,
    write_random_drafter,
)
from tiny_families import (
    assert_greedy_equal,
    hf_greedy,
    read_config,
    write_flat_head,
    write_speculators_head,
    write_tiny_family,
)

from speculative.config import SamplingParams
from workers.layers.fp8 import quantize_rows
from workers.layers.moe import moe_reference, route
from workers.models import MODELS, ModelConfig

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: write_tiny_family(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def prompts():
    return tiny_prompts(3, vocab=96, seed=3, min_len=8, max_len=60)


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_and_greedy_match_transformers(dirs, prompts, family):
    engine = tiny_engine(dirs[family])
    target = engine.executor.target
    assert type(target) is MODELS[read_config(dirs[family])["architectures"][0]]
    moe = engine.executor.target_cfg.moe
    assert [moe.sparse(i) for i in range(4)] == {
        "mixtral": [True] * 4,
        "qwen2_moe": [True, False, True, True],
        "qwen3_moe": [False, True, False, True],
    }[family]
    params = GREEDY.model_copy(update={"prompt_logprobs": 1})
    for prompt, request in zip(prompts, run_to_completion(engine, prompts, params)):
        ours = torch.tensor([chosen for chosen, _ in request.prompt_logprobs])
        torch.testing.assert_close(
            ours, hf_prompt_logprobs(dirs[family], prompt), atol=1e-4, rtol=0
        )
        assert_greedy_equal(request.output_ids, *hf_greedy(dirs[family], prompt, 16))


HEADS = {  # the layouts of published MoE heads
    "flat": write_flat_head,  # lmsys/Qwen3-235B-A22B-EAGLE3, Tengyunw/qwen3_30b_moe_eagle3
    "speculators": write_speculators_head,  # nm-testing/Qwen3-235B-A22B-EAGLE3-converted-...
    "ours": write_random_drafter,
}


@pytest.mark.parametrize(
    "family, head, dtype, quantization",
    [("qwen3_moe", "flat", "float32", None), ("qwen2_moe", "ours", "bfloat16", None),
     ("mixtral", "speculators", "float32", "fp8")],
)  # fmt: skip
def test_speculative_greedy_equals_plain(
    dirs, prompts, tmp_path, family, head, dtype, quantization
):
    """With the heads' layouts, in the GPU's dtype, and with FP8 experts (`--quantization fp8`
    quantizes them, not the router); the speculative steps replayed as graphs (the CPU
    stand-in)."""
    drafter = HEADS[head](tmp_path / "drafter", dirs[family])
    options = dict(dtype=dtype, quantization=quantization)
    plain_engine = tiny_engine(dirs[family], **options)
    sparse = next(l.mlp for l in plain_engine.executor.target.layers if hasattr(l.mlp, "gate"))
    assert (sparse.experts.gate_up.weight_scale is not None) == (quantization == "fp8")
    assert sparse.gate.weight.dtype == getattr(torch, dtype)
    plain = run_to_completion(plain_engine, prompts, GREEDY)
    engine = tiny_engine(dirs[family], drafter, k=3, **options)
    graphs = replay_graphs_on_cpu(engine.executor)
    drafted = run_to_completion(engine, prompts, GREEDY)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    assert sum(g.replays for g in graphs.all()) > 0


def test_auto_k_profiles_the_moe_verify_and_stays_exact(dirs, prompts, tmp_path):
    """`auto` picks K from the verify passes it timed at start on this target: for a MoE target
    a wider verify routes to more experts, and those timings are what say so. bfloat16."""
    target = dirs["qwen3_moe"]
    drafter = write_random_drafter(tmp_path / "drafter", target)
    engine = tiny_engine(target, drafter, k="auto", dtype="bfloat16")
    costs = engine.executor.step_costs
    assert {k for _, k in costs} == set(range(6)) and all(t > 0 for t in costs.values())
    plain = run_to_completion(tiny_engine(target, dtype="bfloat16"), prompts, GREEDY)
    drafted = run_to_completion(engine, prompts, GREEDY)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]


def test_config_reading_and_refusals(dirs):
    cfg = read_config(dirs["qwen2_moe"])
    moe = ModelConfig.from_hf(cfg).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 48)
    assert (moe.shared_expert_size, moe.renormalize, moe.dense_layers) == (96, False, (1,))
    with pytest.raises(ValueError, match="num_experts_per_tok 5 must be 1..num_experts"):
        ModelConfig.from_hf(cfg | {"num_experts_per_tok": 5})
    llama = read_config(dirs["qwen2_moe"]) | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match="num_experts is set: mixture-of-experts layers outside"):
        ModelConfig.from_hf(llama | {"model_type": "llama"})
    deepseek = llama | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    with pytest.raises(ValueError, match="n_routed_experts is set"):
        ModelConfig.from_hf(deepseek | {"n_routed_experts": 64})
    dsv3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    with pytest.raises(ValueError, match="DeepSeek-V3 needs multi-head latent attention"):
        ModelConfig.from_hf(dsv3)


def test_a_missing_expert_is_named(dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(dirs["mixtral"], tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights for \['layers.2.mlp.experts.3.up_proj"):
        tiny_engine(broken)


# ---- the fused kernel ----


def _experts(E, H, inter, dtype, fp8, seed):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = (
        torch.randn(E, 2 * inter, H, generator=g) / 8,
        torch.randn(E, H, inter, generator=g) / 8,
    )
    if not fp8:
        return w13.to(dtype), w2.to(dtype), None, None
    q13, s13 = quantize_rows(w13.reshape(-1, H))
    q2, s2 = quantize_rows(w2.reshape(-1, inter))
    return q13.view(w13.shape), q2.view(w2.shape), s13.view(E, -1), s2.view(E, -1)


ROUTINGS = {  # name -> (experts, top-k, tokens, forced expert ids or None)
    "top1 one token": (4, 1, 1, None),
    "top2": (8, 2, 5, None),
    "top4 many tokens": (6, 4, 37, None),
    "top8 of 16": (16, 8, 7, None),
    "all to one expert": (5, 1, 20, [[3]] * 20),
    "one token each, rest empty": (12, 2, 2, [[0, 11], [5, 7]]),
}


@pytest.mark.parametrize("dtype, fp8", [(torch.float32, False), (torch.float16, False),
                                        (torch.float32, True)])  # fmt: skip
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_fused_kernel_equals_the_loop_over_experts(routing, dtype, fp8):
    pytest.importorskip("triton")
    from workers.layers.fused_moe import fused_moe

    E, k, T, forced = ROUTINGS[routing]
    H, inter = 64, 40  # a tail in every block of K and N
    weights = _experts(E, H, inter, dtype, fp8, seed=T)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(T, H, generator=g).to(dtype)
    route_weights, ids = route(torch.randn(T, E, generator=g), k, renormalize=True)
    if forced is not None:
        ids = torch.tensor(forced)
    w13, w2, s13, s2 = weights
    ours = fused_moe(x, w13, w2, route_weights, ids, s13, s2)
    reference = moe_reference(x, w13, w2, route_weights, ids, s13, s2)
    tol = 2e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(ours.float(), reference.float(), atol=tol, rtol=tol)


def test_alignment_groups_every_entry_once():
    pytest.importorskip("triton")
    from workers.layers.fused_moe import align_by_expert

    ids = torch.tensor([[2, 0], [2, 1], [2, 0], [4, 2]])
    sorted_ids, block_expert = align_by_expert(ids, num_experts=6, block_m=4)
    blocks = sorted_ids.view(-1, 4)
    flat = ids.flatten()
    seen = []
    for block, expert in zip(blocks.tolist(), block_expert.tolist()):
        entries = [e for e in block if e < flat.numel()]
        assert all(flat[e] == expert for e in entries)
        seen += entries
    assert sorted(seen) == list(range(flat.numel()))
    # four entries of expert 2 fill one block; 3 and 5 have none; unused blocks say 6
    assert block_expert.tolist() == [0, 1, 2, 4, 6, 6, 6]


def test_fp8_checkpoint_experts_load_as_stored(tmp_path):
    """A compressed-tensors FP8_DYNAMIC checkpoint of a MoE target (llm-compressor's layout:
    every expert's projections FP8 with a scale per channel, the router not): the experts hold
    the file's FP8 bytes and scales, the router stays float, and the FP8 experts compute what
    their dequantized weights do."""
    from safetensors.torch import load_file
    from tiny_fp8 import write_fp8

    src = write_tiny_family(tmp_path / "float", "qwen3_moe")
    fp8_dir = write_fp8(src, tmp_path / "fp8", "ct-channel")
    block = tiny_engine(fp8_dir).executor.target.layers[1].mlp
    gate_up, down = block.experts.gate_up, block.experts.down
    stored = load_file(str(fp8_dir / "model.safetensors"))
    up = "model.layers.1.mlp.experts.5.up_proj.weight"
    rows = gate_up.weight.shape[1] // 2
    assert torch.equal(gate_up.weight[5, rows:].view(torch.uint8), stored[up].view(torch.uint8))
    torch.testing.assert_close(gate_up.weight_scale[5, rows:], stored[up + "_scale"][:, 0].float())
    assert block.gate.weight.dtype == torch.float32 and down.weight_scale is not None
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = route(block.gate(x), block.top_k, block.renormalize)
    dequantized = [w.weight.float() * w.weight_scale[..., None] for w in (gate_up, down)]
    torch.testing.assert_close(
        block.experts(x, weights, ids), moe_reference(x, *dequantized, weights, ids)
    )
