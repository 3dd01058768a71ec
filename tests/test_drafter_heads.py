"""Both published EAGLE-3 head layouts loaded into the engine for tiny targets of the new
families: the flat one of the EAGLE authors and SpecForge, and vLLM's speculators one. Speculative
greedy equals plain greedy over prompts longer than the heads' max_position_embeddings (32), and
each head's own fields are read (its RoPE, aux layers, draft vocabulary, norm flag)."""

import json

import pytest
from conftest import run_to_completion, tiny_engine, tiny_prompts
from tiny_families import write_flat_head, write_speculators_head, write_tiny_family

from speculative.config import SamplingParams
from speculative.drafter_format import read_drafter_config
from workers.layers.attention import attention_inputs

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    # the target scales its RoPE from theta 500000, as Llama 3.1's; the flat head says nothing
    llama = write_tiny_family(root / "llama", "llama", "llama3", rope_theta=500000.0)
    qwen3 = write_tiny_family(root / "qwen3", "qwen3")
    return {
        "flat": (llama, write_flat_head(root / "flat", llama)),
        "speculators-llama": (llama, write_speculators_head(root / "spec-llama", llama)),
        "speculators-qwen3": (qwen3, write_speculators_head(root / "spec-qwen3", qwen3, "qwen3")),
    }


def test_each_head_reads_its_own_fields(heads):
    flat = read_drafter_config(heads["flat"][1])
    assert (flat.rope_theta, flat.rope_scaling, flat.norm_before_residual) == (10000.0, None, False)
    assert flat.draft_vocab_size == 48 and flat.aux_layer_ids is None
    llama = read_drafter_config(heads["speculators-llama"][1])
    assert llama.norm_before_residual and llama.aux_layer_ids == (0, 1, 2)
    assert llama.rope_theta == 500000.0 and llama.draft_vocab_size == 48
    qwen3 = read_drafter_config(heads["speculators-qwen3"][1])
    assert qwen3.head_dim == 24 and qwen3.head_dim * qwen3.num_attention_heads != 64


@pytest.mark.parametrize("name", ["flat", "speculators-llama", "speculators-qwen3"])
def test_speculative_greedy_equals_plain(heads, name):
    target, head = heads[name]
    prompts = tiny_prompts(3, vocab=96, seed=4, min_len=40, max_len=120)  # past the head's 32
    plain = run_to_completion(tiny_engine(target, max_model_len=256), prompts, GREEDY)
    engine = tiny_engine(target, head, k=3, max_model_len=256)
    assert engine.executor.max_model_len == 256  # the head's 32 positions cap nothing
    drafted = run_to_completion(engine, prompts, GREEDY)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"use_fancy_norm": True}, "use_fancy_norm"),
        ({"speculators_model_type": "eagle"}, "speculators_model_type"),
        ({"transformer_layer_config": {"model_type": "mistral"}}, "model_type 'mistral'"),
        ({"transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 2}}, "1"),
    ],
)
def test_unsupported_speculators_fields_refused_by_name(heads, tmp_path, changes, named):
    config = json.loads((heads["speculators-llama"][1] / "config.json").read_text())
    if "transformer_layer_config" in changes:
        changes = {
            "transformer_layer_config": config["transformer_layer_config"]
            | changes["transformer_layer_config"]
        }
    (tmp_path / "config.json").write_text(json.dumps(config | changes))
    with pytest.raises(ValueError, match=named):
        read_drafter_config(tmp_path)


def test_norm_before_residual_takes_the_normed_hidden_as_residual():
    """The layer's output against its definition written out (speculators' and vLLM's): the
    residual around attention is hidden_norm(hidden) with the flag, the raw hidden without; the
    two differ, so the flag is read."""
    import dataclasses

    import torch
    from tiny_models import attach_kv, prefill_batch

    from speculative.drafter import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=64, draft_vocab_size=64,
        target_hidden_size=32, aux_layer_ids=None,
    )  # fmt: skip
    outputs = {}
    for flag in (False, True):
        torch.manual_seed(0)
        drafter = Eagle3Drafter(dataclasses.replace(cfg, norm_before_residual=flag))
        for p in drafter.parameters():  # norm weights away from 1, so normalising shows
            p.data.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
        kv = attach_kv(drafter, 1, 32, drafter=True)
        layer = drafter.midlayer
        embeds, hidden = torch.randn(1, 5, 32), 3 * torch.randn(1, 5, 32)
        batch = prefill_batch(kv, [0], torch.arange(5).unsqueeze(0), 5)
        got = layer(embeds, hidden, batch)
        kv.target.zero_()  # the reference writes the same K/V again
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        attn = layer.self_attn(x, batch, attention_inputs(batch, layer.self_attn, x.dtype))
        h = (normed if flag else hidden) + attn
        torch.testing.assert_close(got, h + layer.mlp(layer.post_attention_layernorm(h)))
        outputs[flag] = got
    assert not torch.allclose(outputs[False], outputs[True], atol=1e-3)
