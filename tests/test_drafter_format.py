"""The EAGLE-3 drafter checkpoint format: our save/load round trip, a checkpoint laid out exactly as
the EAGLE authors publish it (run in the engine against a tiny target), and refusal of pickles."""

import json
import pickle

import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts
from safetensors.torch import save_file
from tiny_models import attach_kv, prefill_batch

from speculative.config import SamplingParams
from speculative.drafter import DrafterConfig
from speculative.drafter_format import (
    drafter_config_for,
    drafter_state_dict,
    drafter_tensors,
    load_drafter,
    random_drafter_state,
    save_drafter,
)
from speculative.drafter_int8 import quantize_int8
from workers.models import ModelConfig, load_config


def drafter_outputs(drafter, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm output and proposals of a first draft forward over 5 tokens (fresh KV cache)."""
    cfg = drafter.cfg
    kv = attach_kv(drafter, 1, 16, drafter=True)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=g)
    features = torch.randn(1, 5, drafter.fc.weight.shape[1], generator=g)
    positions = torch.arange(5).unsqueeze(0)
    h = drafter(ids, features, prefill_batch(kv, [0], positions, 5), from_features=True)
    return h, drafter.propose(h)[..., 0]


@pytest.mark.parametrize("with_embeddings", [False, True])
def test_save_load_round_trip(tmp_path, tiny_dir, with_embeddings):
    target_cfg = ModelConfig.from_hf(load_config(tiny_dir))
    cfg = drafter_config_for(target_cfg, draft_vocab_size=40, aux_layer_ids=(1, 2, 3))
    state = random_drafter_state(cfg, seed=3, with_embeddings=with_embeddings)
    state["d2t"] = torch.randint(0, 24, (40,))  # a non-trivial vocabulary map
    save_drafter(tmp_path / "a", cfg, state)
    embeddings = None
    if not with_embeddings:
        from workers.layers.parallel import VocabParallelEmbedding

        embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        embeddings.weight.data.normal_()
    first = load_drafter(tmp_path / "a", target_embeddings=embeddings)
    assert DrafterConfig.from_hf(json.loads((tmp_path / "a" / "config.json").read_text())) == cfg
    loaded = drafter_state_dict(first)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    save_drafter(tmp_path / "b", first.cfg, loaded)
    second = load_drafter(tmp_path / "b", target_embeddings=embeddings)
    for a, b in zip(drafter_outputs(first), drafter_outputs(second)):
        assert torch.equal(a, b)


def test_sharded_save(tmp_path, tiny_dir):
    """Over `max_shard_bytes` the weights go into Hugging Face style shards with an index, which
    load to the same drafter; saving again into that directory leaves no stale shard behind."""
    target_cfg = ModelConfig.from_hf(load_config(tiny_dir))
    cfg = drafter_config_for(target_cfg, draft_vocab_size=40)
    state = random_drafter_state(cfg, seed=5, with_embeddings=True)
    largest = max(t.numel() * t.element_size() for t in state.values())
    save_drafter(tmp_path, cfg, state, max_shard_bytes=largest)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in tmp_path.glob("*.safetensors"):
        assert shard.stat().st_size <= largest + 4096  # + the safetensors header
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == state.keys() and set(index["weight_map"].values()) == set(
        shards
    )
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    loaded = drafter_state_dict(load_drafter(tmp_path))
    assert all(torch.equal(loaded[n], t) for n, t in state.items())
    save_drafter(tmp_path, cfg, state)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert all(
        torch.equal(drafter_state_dict(load_drafter(tmp_path))[n], t) for n, t in state.items()
    )


def test_int8_storage(tmp_path, tiny_dir):
    """quantize_int8: every 2-D weight as int8 rows + a scale each, under 0.55x the bfloat16 bytes;
    it loads to weights within half a step of each row's scale, and the drafter
    proposes as before."""
    target_cfg = ModelConfig.from_hf(load_config(tiny_dir))
    cfg = drafter_config_for(target_cfg, draft_vocab_size=40)
    state = random_drafter_state(cfg, seed=7, with_embeddings=True)
    save_drafter(tmp_path / "bf16", cfg, state, torch.bfloat16)
    save_drafter(tmp_path / "int8", cfg, quantize_int8(state))
    sizes = {
        d: sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors"))
        for d in ("bf16", "int8")
    }
    assert sizes["int8"] < 0.55 * sizes["bf16"], sizes
    int8 = load_drafter(tmp_path / "int8")
    loaded = drafter_state_dict(int8)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dim() == 2:
            step = tensor.abs().amax(dim=1, keepdim=True) / 127
            assert ((loaded[name] - tensor).abs() <= step / 2 + 1e-6).all(), name
            assert not torch.equal(loaded[name], tensor)  # quantized indeed
        else:
            assert torch.allclose(loaded[name], tensor.to(loaded[name].dtype), rtol=1e-2), name
    h_float, ids_float = drafter_outputs(load_drafter(tmp_path / "bf16"))
    h_int8, ids_int8 = drafter_outputs(int8)
    assert torch.allclose(h_int8, h_float, atol=0.05 * h_float.abs().max().item())
    assert (ids_int8 == ids_float).float().mean() >= 0.8
    # a weight without its scale, or a scale without its weight (say, a shard missing), is refused
    stored = quantize_int8(state)
    for missing in ("fc.weight_scale", "fc.weight"):
        save_drafter(tmp_path / "broken", cfg, {n: t for n, t in stored.items() if n != missing})
        with pytest.raises(ValueError, match="fc.weight"):
            load_drafter(tmp_path / "broken")


# ---- the EAGLE authors' layout ----


def write_authors_checkpoint(path, target_cfg: ModelConfig, draft_vocab_size: int, seed: int = 0):
    """config.json shaped like yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (scaled down): no
    target_hidden_size, no head_dim, no aux layer ids, draft_vocab_size; tensors named midlayer.*,
    fc, norm, lm_head, d2t, t2d; no embed_tokens (shared with the target)."""
    H, I, V = target_cfg.hidden_size, target_cfg.intermediate_size, target_cfg.vocab_size
    heads, kv = target_cfg.num_attention_heads, target_cfg.num_key_value_heads
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": I,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": V,
        "draft_vocab_size": draft_vocab_size,
    }
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).half()

    # the draft vocabulary: a sorted subset of target ids; d2t[i] = target id - i, t2d marks members
    vocab = torch.randperm(V, generator=g)[:draft_vocab_size].sort().values
    cfg = drafter_config_for(target_cfg, draft_vocab_size)
    tensors = drafter_tensors(cfg, w, dtype=torch.float16) | {
        "d2t": vocab - torch.arange(draft_vocab_size),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, vocab, True),
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return vocab


def test_authors_checkpoint_runs_in_engine(tmp_path, tiny_dir):
    target_cfg = ModelConfig.from_hf(load_config(tiny_dir))
    vocab = write_authors_checkpoint(tmp_path / "eagle3", target_cfg, draft_vocab_size=24)
    prompts = tiny_prompts(4, seed=9)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = run_to_completion(tiny_engine(tiny_dir), prompts, params)
    engine = tiny_engine(tiny_dir, tmp_path / "eagle3", k=3, overlap=False)
    drafter = engine.executor.drafter
    assert (
        drafter.cfg.target_hidden_size == target_cfg.hidden_size
        and drafter.cfg.draft_vocab_size == 24
    )
    assert (
        not drafter.has_own_embeddings
        and drafter.embed_tokens is engine.executor.target.embed_tokens
    )
    proposed = set()
    requests = []
    for prompt in prompts:
        requests.append(engine.add_request(prompt, params))
    while engine.has_work:
        engine.step()
        proposed |= set(engine.executor.state.drafts[:-1].flatten().tolist())
    assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
    # drafts are target ids reached through d2t: members of the draft vocabulary,
    # beyond its first 24 ids
    assert proposed <= set(vocab.tolist()) | {0}
    assert max(proposed) >= 24


def test_pickled_checkpoints_are_refused_unopened(tmp_path):
    """A directory with only pytorch_model.bin is refused with a clear error; the pickle is never
    loaded (it would create a marker file if it were)."""
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):
            return (marker.mkdir, ())

    for kind in ("drafter", "target"):
        d = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text(
            json.dumps(
                {
                    "num_hidden_layers": 1,
                    "hidden_size": 8,
                    "intermediate_size": 8,
                    "num_attention_heads": 2,
                    "vocab_size": 16,
                }
            )
        )
        (d / "pytorch_model.bin").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(
        FileNotFoundError, match=r"no safetensors weights .*pytorch_model\.bin.*pickled"
    ):
        load_drafter(tmp_path / "drafter")
    from workers.models.llama import Llama
    from workers.models.loader import load_target_weights

    cfg = ModelConfig.from_hf(load_config(tmp_path / "target"))
    with pytest.raises(FileNotFoundError, match=r"pickled checkpoints are not loaded"):
        load_target_weights(Llama(cfg, aux_layer_ids=()), tmp_path / "target")
    assert not marker.exists()
    pickle.loads((tmp_path / "target" / "pytorch_model.bin").read_bytes())  # the marker works
    assert marker.exists()


def test_random_default_drafters_do_not_collide(tmp_path, monkeypatch):
    """Two different targets in directories of the same name each get a default
    drafter of their shape."""
    monkeypatch.setenv("EAGLESERVE_CACHE", str(tmp_path / "cache"))
    from conftest import write_tiny_llama

    a = write_tiny_llama(tmp_path / "a" / "model", hidden_size=64)
    b = write_tiny_llama(tmp_path / "b" / "model", hidden_size=32, intermediate_size=64)
    for d in (a, b, a):
        engine = tiny_engine(d, "default", k=2)
        assert (
            engine.executor.drafter.cfg.hidden_size
            == ModelConfig.from_hf(load_config(d)).hidden_size
        )
        run_to_completion(engine, tiny_prompts(1), SamplingParams(max_tokens=4, ignore_eos=True))


# ---- checks at load time ----


def _small_drafter(tmp_path, mutate=None, **changes):
    """A drafter for a target of 64 tokens and hidden size 64, draft vocabulary 16,
    after `mutate(state)`."""
    from dataclasses import replace

    target = ModelConfig.from_hf(
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    cfg = replace(drafter_config_for(target, 16), **changes)
    state = random_drafter_state(cfg)
    if mutate:
        mutate(state)
    save_drafter(tmp_path / "drafter", cfg, state)
    return tmp_path / "drafter"


def _target_embeddings(vocab=64, hidden=64):
    from workers.layers.parallel import VocabParallelEmbedding

    return VocabParallelEmbedding(vocab, hidden)


def _set(name, value):
    return lambda state: state.__setitem__(name, value)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_set("d2t", torch.tensor([5])), r"d2t must be 16 integers, not torch.int64 \[1\]"),
        (_set("d2t", torch.full((16,), 2.7)), "d2t must be 16 integers, not torch.float32"),
        (
            _set("d2t", torch.full((16,), 1000)),
            "d2t maps draft tokens to ids outside the 64-token vocabulary",
        ),
        (_set("d2t", torch.full((16,), -1)), "d2t maps draft tokens to ids outside"),
        (_set("t2d", torch.tensor([True])), r"t2d must be 64 bools, not torch.bool \[1\]"),
        (_set("t2d", torch.ones(64, dtype=torch.long)), "t2d must be 64 bools, not torch.int64"),
        (lambda s: s.pop("t2d"), "lacks t2d"),
        (
            _set("lm_head.weight", torch.randn(40, 64)),
            r"'lm_head.weight' has shape \[40, 64\], .* \[16, 64\]",
        ),
        (_set("lm_head.weight", torch.randn(8, 64)), r"'lm_head.weight' has shape \[8, 64\]"),
        (
            _set("midlayer.hidden_norm.weight", torch.ones(1)),
            r"'midlayer.hidden_norm.weight' has shape \[1\]",
        ),
        (
            _set("midlayer.self_attn.q_proj.weight", torch.randn(64, 64)),
            r"q_proj.weight' has shape \[64, 64\], .* \[64, 128\]",
        ),
        (_set("junk", torch.zeros(1)), "unexpected tensor 'junk'"),
    ],
)
def test_wrong_drafter_tensors_are_refused(tmp_path, mutate, message):
    path = _small_drafter(tmp_path, mutate)
    with pytest.raises(ValueError, match=f"drafter {path}.*{message}"):
        load_drafter(path, target_embeddings=_target_embeddings())


def test_int8_scales_are_one_per_row(tmp_path):
    def flat_scale(state):
        quantized = quantize_int8(dict(state))
        name = "midlayer.self_attn.o_proj.weight_scale"
        quantized[name] = quantized[name].flatten()
        state.clear()
        state.update(quantized)

    path = _small_drafter(tmp_path, flat_scale)
    with pytest.raises(
        ValueError, match=r"o_proj.weight_scale has shape \[64\], expected \[rows, 1\]"
    ):
        load_drafter(path, target_embeddings=_target_embeddings())


def test_aux_layer_ids_must_match_fc(tmp_path):
    path = _small_drafter(tmp_path, aux_layer_ids=(0, 1))  # fc written for 3 aux layers
    with pytest.raises(
        ValueError, match=r"drafter .*'fc.weight' has shape \[64, 192\], .* \[64, 128\]"
    ):
        load_drafter(path, target_embeddings=_target_embeddings())


@pytest.mark.parametrize(
    "changes, embeddings, message",
    [
        (
            dict(target_hidden_size=48),
            (64, 64),
            "made for a target with 64 tokens and hidden size 48, not this one",
        ),
        (
            dict(),
            (100, 64),
            "made for a target with 64 tokens and hidden size 64, not this one \\(100, 64\\)",
        ),
        (
            dict(hidden_size=48, head_dim=12),
            (64, 64),
            "has hidden size 48 but no embed_tokens.weight of its own",
        ),
    ],
)
def test_drafter_must_fit_the_target(tmp_path, changes, embeddings, message):
    path = _small_drafter(tmp_path, **changes)
    with pytest.raises(ValueError, match=f"drafter {path}.* {message}"):
        load_drafter(path, target_embeddings=_target_embeddings(*embeddings))


def test_engine_refuses_a_misfit_drafter_at_load(tmp_path, tiny_dir):
    """A d2t leaving the vocabulary (a device assert on CUDA) fails while the engine loads, naming
    the drafter, not in the first draft step."""
    path = _small_drafter(tmp_path, _set("d2t", torch.full((16,), 60)))
    with pytest.raises(ValueError, match=f"drafter {path}: d2t maps draft tokens to ids outside"):
        tiny_engine(tiny_dir, path)
