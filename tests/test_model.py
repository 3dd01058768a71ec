"""The target model against Hugging Face transformers: weights (GGUF conversion), logits, and greedy
generation of the real SmolLM2-135M token for token."""

import json
import re
import time

import numpy as np
import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts, write_tiny_llama
from tiny_models import attach_kv, prefill_batch

from speculative.config import SamplingParams
from workers.models import ModelConfig, load_config
from workers.models.llama import Llama
from workers.models.loader import iter_safetensors, load_target_weights


def our_llama(model_dir, max_len: int = 128) -> Llama:
    """Our target on two request slots, with its KV cache (`model.kv`) attached."""
    cfg = ModelConfig.from_hf(load_config(model_dir))
    model = Llama(cfg, max_positions=max_len, aux_layer_ids=())
    load_target_weights(model, model_dir)
    model.kv = attach_kv(model, 2, max_len)
    return model


def full_forward_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    positions = torch.arange(len(ids)).unsqueeze(0)
    hidden, _ = model(torch.tensor([ids]), prefill_batch(model.kv, [0], positions, len(ids)))
    return model.logits(hidden)[0]


def test_gqa_attention_equals_folded(tmp_path, monkeypatch):
    """Both ways of running the attention (GQA from strided queries, or the query heads folded into
    the query length) give the same logits, for one and for several tokens per row, over cached
    keys."""
    import workers.layers.attention

    model = our_llama(write_tiny_llama(tmp_path / "m", num_heads=4, num_kv_heads=2, seed=5))
    # random pools: rows past each position must stay masked
    model.kv.target.normal_()
    ids = torch.tensor(tiny_prompts(2, seed=3, min_len=5, max_len=5))
    logits = {}
    for gqa in (True, False):
        monkeypatch.setattr(workers.layers.attention_backend, "use_gqa", lambda *args, gqa=gqa: gqa)
        for T in (5, 1):
            positions = torch.tensor([[7], [11]]) + torch.arange(T)
            hidden, _ = model(ids[:, :T], prefill_batch(model.kv, [0, 1], positions, 32))
            logits[gqa, T] = model.logits(hidden)
    for T in (5, 1):
        torch.testing.assert_close(logits[True, T], logits[False, T], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie, layers", [(False, 4), (True, 2)])
def test_tiny_logits_match_hf(tmp_path, tie, layers):
    from transformers import AutoModelForCausalLM

    model_dir = write_tiny_llama(tmp_path / "m", tie=tie, num_layers=layers, seed=11)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tiny_prompts(1, seed=2, min_len=30, max_len=30)[0]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        ours = full_forward_logits(our_llama(model_dir), ids)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie, layers", [(False, 4), (True, 2)])
def test_tiny_greedy_matches_hf_generate(tmp_path, tie, layers):
    """Batched engine output (different prompt lengths, continuous batching) == HF generate one by
    one. The 2-layer target is shallower than the default aux layers (2, L/2, L-3): plain runs
    anyway."""
    from transformers import AutoModelForCausalLM

    tiny_dir = write_tiny_llama(tmp_path / "m", tie=tie, num_layers=layers, seed=12)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    prompts = tiny_prompts(6, seed=4)
    requests = run_to_completion(
        tiny_engine(tiny_dir, max_batch_size=4),
        prompts,
        SamplingParams(max_tokens=32, ignore_eos=True),
        [0, 0, 1, 2, 6, 7],
    )
    for prompt, r in zip(prompts, requests):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert r.output_ids == out[0, len(prompt) :].tolist()


def test_gguf_conversion_matches_hf_dequantization(smollm2_dir, hf_smollm2):
    """Our GGUF -> safetensors conversion (dequantize + undo llama.cpp's q/k row permutation) gives
    exactly the tensors Hugging Face's own GGUF loader produces."""
    hf_state = hf_smollm2.state_dict()
    names = 0
    for name, tensor in iter_safetensors(smollm2_dir):
        torch.testing.assert_close(tensor, hf_state[name], rtol=0, atol=0, msg=name)
        names += 1
    assert names == 30 * 9 + 2  # tied embeddings: no lm_head.weight


@pytest.fixture(scope="module")
def hf_greedy_64(hf_smollm2, smollm2_prompts, smollm2_engine):
    """HF `generate`, greedy, 64 new tokens, batches of 10 left-padded prompts (padding moves HF's
    numbers by float noise only; the near-tie rule covers what that could flip)."""
    eos = sorted(smollm2_engine.scheduler.eos_token_ids)
    outs = []
    with torch.no_grad():
        for start in range(0, len(smollm2_prompts), 10):
            batch = smollm2_prompts[start : start + 10]
            T = max(map(len, batch))
            ids = torch.tensor([[eos[0]] * (T - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in batch])
            out = hf_smollm2.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )[:, T:].tolist()
            outs += [o[: next((i + 1 for i, t in enumerate(o) if t in eos), len(o))] for o in out]
    return outs


def test_smollm2_greedy_matches_hf_generate(
    smollm2_prompts, smollm2_greedy_64, hf_greedy_64, smollm2_near_tie
):
    """20 benchmark prompts with the chat template, run as ONE batch of different prompt lengths
    (fp32, CPU), against HF generate from the GGUF file: equal, or the first difference a
    near-tie."""
    assert len(smollm2_prompts) == 20 and len({len(p) for p in smollm2_prompts}) > 10
    for prompt, ours, ref in zip(smollm2_prompts, smollm2_greedy_64, hf_greedy_64):
        smollm2_near_tie(prompt, ours, ref)
    print(f"{sum(o == r for o, r in zip(smollm2_greedy_64, hf_greedy_64))}/20 identical")


# ---- loading refuses what does not fit, naming the file ----


def rewrite_tensors(model_dir, **changes):
    """Replace (a tensor) or drop (None) checkpoint tensors of a model directory."""
    from safetensors.torch import load_file, save_file

    file = model_dir / "model.safetensors"
    tensors = load_file(str(file)) | changes
    save_file({n: t for n, t in tensors.items() if t is not None}, str(file))
    return model_dir


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"model.norm.weight": torch.tensor([7.0])},
            r"'model.norm.weight' has shape \[1\], .* \[64\]",
        ),
        (
            {"model.layers.0.self_attn.q_proj.weight": torch.zeros(128, 64)},
            r"q_proj.weight' has shape \[128, 64\], .* \[64, 64\]",
        ),
        (
            {"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 1)},
            r"o_proj.weight' has shape \[64, 1\]",
        ),
        (
            {"model.layers.3.mlp.down_proj.weight": torch.zeros(64, 999)},
            r"down_proj.weight' has shape \[64, 999\]",
        ),
        (
            {"model.embed_tokens.weight": torch.zeros(60, 64)},
            r"embed_tokens.weight' has shape \[60, 64\], .* \[64, 64\]",
        ),
        ({"lm_head.weight": torch.zeros(80, 64)}, r"lm_head.weight' has shape \[80, 64\]"),
        (
            {"model.layers.1.self_attn.k_proj.weight": None},
            r"lacks weights for \['layers.1.self_attn.k_proj.weight'\]",
        ),
        (
            {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)},
            r"unexpected tensor 'model.layers.0.self_attn.q_proj.bias'",
        ),
        ({"junk": torch.zeros(1)}, r"unexpected tensor 'junk'"),
    ],
)
def test_wrong_target_tensors_are_refused(tmp_path, changes, message):
    model_dir = rewrite_tensors(write_tiny_llama(tmp_path / "m"), **changes)
    with pytest.raises(ValueError, match=f"{tmp_path / 'm'}.*{message}"):
        our_llama(model_dir)


def test_config_and_checkpoint_shapes_must_agree(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "m")
    config = load_config(model_dir)
    for key, value, tensor in (
        ("vocab_size", 100, "(embed_tokens|lm_head)"),
        ("intermediate_size", 96, "mlp.*_proj"),
    ):
        (model_dir / "config.json").write_text(json.dumps(config | {key: value}))
        with pytest.raises(ValueError, match=f"{tensor}.weight' has shape"):
            our_llama(model_dir)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive int"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, "3 does not divide hidden_size 64"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({"hidden_size": "64"}, "hidden_size must be a positive int, not '64'"),
        ({"vocab_size": -1}, "vocab_size must be a positive int"),
        ({"intermediate_size": 1.5}, "intermediate_size must be a positive int"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive int"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive float"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive float"),
        ({"num_hidden_layers": None}, "lacks num_hidden_layers"),
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "Gemma.*supported are"),
        ({"model_type": "qwen2"}, "'qwen2', architectures \\['LlamaForCausalLM'\\]: supported"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not supported"),
        ({"attention_bias": True}, "attention_bias is set"),
        ({"mlp_bias": True}, "mlp_bias is set"),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "unsupported rope type 'longrope'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling of type 'llama3' lacks a number low_freq_factor",
        ),
    ],
)
def test_config_json_is_validated(tmp_path, changes, message):
    model_dir = write_tiny_llama(tmp_path / "m")
    config = {k: v for k, v in (load_config(model_dir) | changes).items() if v is not None}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        ModelConfig.from_hf(load_config(model_dir))


def test_supported_configs_pass(smollm2_dir, tmp_path):
    from workers.models.loader import RANDOM_SHAPES

    cfg = ModelConfig.from_hf(load_config(smollm2_dir))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        576,
        9,
        3,
        64,
    )
    for tie in (False, True):
        ModelConfig.from_hf(load_config(write_tiny_llama(tmp_path / str(tie), tie=tie)))
    for shape in RANDOM_SHAPES.values():
        ModelConfig.from_hf(shape)
    # an explicit head_dim need not divide the hidden size; a default rope_scaling entry is fine
    ModelConfig.from_hf(
        load_config(smollm2_dir)
        | {
            "num_attention_heads": 7,
            "num_key_value_heads": 1,
            "rope_scaling": {"rope_type": "default"},
        }
    )


@pytest.mark.parametrize(
    "damage", ["truncated", "config", "index", "index_no_map", "index_outside"]
)
def test_malformed_files_are_named(tmp_path, damage):
    model_dir = write_tiny_llama(tmp_path / "m")
    weights, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    bad = {"truncated": weights, "config": model_dir / "config.json"}.get(damage, index)
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage in ("config", "index"):
        bad.write_text("{not json")
    else:
        index.write_text(
            json.dumps(
                {"metadata": {}}
                if damage == "index_no_map"
                else {"weight_map": {"a": "../../etc/passwd"}}
            )
        )
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        our_llama(model_dir)


def test_random_model_config_is_replaced_not_rewritten(tmp_path, monkeypatch):
    """Every TP rank resolves `random:<shape>`: the config is written only when it differs, and
    then replaced whole (a rank reading it never sees a truncated file)."""
    from workers.models.loader import resolve_model

    monkeypatch.setenv("EAGLESERVE_CACHE", str(tmp_path))
    config = resolve_model("random:smollm2-135m") / "config.json"
    before = config.stat()
    time.sleep(0.01)
    resolve_model("random:smollm2-135m")
    assert (config.stat().st_ino, config.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    config.write_text("{")
    resolve_model("random:smollm2-135m")
    assert (
        load_config(config.parent)["hidden_size"] == 576 and config.stat().st_ino != before.st_ino
    )
    assert [p.name for p in config.parent.iterdir()] == ["config.json"]


# ---- GGUF ----


def write_tiny_gguf(
    path, H=32, heads=4, kv=2, D=None, V=64, I=64, L=2, omit=(), metadata=None, tensors=None
):
    """A float32 llama GGUF in llama.cpp's layout, without tokenizer metadata."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    meta = {
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv,
        "llama.embedding_length": H,
        "llama.feed_forward_length": I,
        "llama.block_count": L,
        "llama.context_length": 256,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    } | (metadata or {})
    for key, value in meta.items():
        if key not in omit:
            (
                w.add_string
                if isinstance(value, str)
                else w.add_float32
                if isinstance(value, float)
                else w.add_uint32
            )(key, value)
    D = D or H // heads

    def t(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    all_tensors = {
        "token_embd.weight": t(V, H),
        "output_norm.weight": np.ones(H, np.float32),
        "output.weight": t(V, H),
    }
    for i in range(L):
        all_tensors |= {
            f"blk.{i}.attn_q.weight": t(heads * D, H),
            f"blk.{i}.attn_k.weight": t(kv * D, H),
            f"blk.{i}.attn_v.weight": t(kv * D, H),
            f"blk.{i}.attn_output.weight": t(H, heads * D),
            f"blk.{i}.ffn_gate.weight": t(I, H),
            f"blk.{i}.ffn_up.weight": t(I, H),
            f"blk.{i}.ffn_down.weight": t(H, I),
            f"blk.{i}.attn_norm.weight": np.ones(H, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(H, np.float32),
        }
    for name, array in (all_tensors | (tensors or {})).items():
        if name not in omit:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(omit=("llama.attention.head_count",)),
            "GGUF lacks metadata llama.attention.head_count",
        ),
        (
            dict(omit=("llama.attention.layer_norm_rms_epsilon",)),
            "GGUF lacks metadata llama.attention.layer_norm_rms",
        ),
        (dict(omit=("token_embd.weight",)), "GGUF lacks tensor token_embd.weight"),
        (
            dict(
                metadata={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}
            ),
            "llama.rope.scaling.type = 'longrope' is not supported",
        ),
        (
            dict(metadata={"llama.rope.scaling.factor": 4.0}),
            "llama.rope.scaling.factor = 4.0 is not supported",
        ),
        (
            dict(metadata={"llama.rope.dimension_count": 4}),
            "llama.rope.dimension_count = 4 is not supported",
        ),
        (
            dict(tensors={"rope_freqs.weight": np.array([1, 4, 8], np.float32)}),
            "rope_freqs.weight .* not supported",
        ),
        (
            dict(tensors={"blk.0.attn_q.bias": np.zeros(32, np.float32)}),
            "unsupported tensor blk.0.attn_q.bias",
        ),
        (
            dict(tensors={"blk.0.attn_q_norm.weight": np.ones(8, np.float32)}),
            "unsupported tensor blk.0.attn_q_norm",
        ),
        (dict(tensors={"mystery": np.ones(8, np.float32)}), "unsupported tensor mystery"),
    ],
)
def test_unsupported_ggufs_are_refused(tmp_path, kwargs, message):
    from workers.models.gguf import read_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ValueError, match=f"{path}: .*{message}"):
        read_gguf(path)


def test_truncated_gguf_is_refused(tmp_path):
    from workers.models.gguf import read_gguf

    path = write_tiny_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    for size in (10, 2000, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"{path} is truncated or not a GGUF"):
            read_gguf(path)


def test_gguf_head_dim_from_key_length(tmp_path):
    """Heads wider than hidden / heads (llama.attention.key_length) load whole; a rope_freqs.weight
    of ones (plain rope) is skipped."""
    from safetensors.torch import save_file

    from workers.models.gguf import read_gguf

    path = write_tiny_gguf(
        tmp_path / "m.gguf",
        H=32,
        heads=2,
        kv=2,
        D=32,
        metadata={"llama.attention.key_length": 32, "llama.attention.value_length": 32},
        tensors={"rope_freqs.weight": np.ones(16, np.float32)},
    )
    config, tensors = read_gguf(path)
    assert config["head_dim"] == 32
    model_dir = tmp_path / "converted"
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(config))
    model = our_llama(model_dir)
    assert model.layers[0].self_attn.qkv_proj.weight.shape == (3 * 64, 32)
    assert full_forward_logits(model, [1, 2, 3]).isfinite().all()


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """A fresh conversion cache; conversions counted, the tokenizer step a stub (tiny GGUFs have
    none)."""
    from transformers import AutoTokenizer

    from workers.models import gguf

    monkeypatch.setenv("EAGLESERVE_CACHE", str(tmp_path / "cache"))
    calls = []
    real = gguf.read_gguf

    def counted(path):
        calls.append(path)
        time.sleep(0.2)  # a conversion takes a while: let concurrent callers overlap
        return real(path)

    class NoTokenizer:
        def save_pretrained(self, out):
            pass

    monkeypatch.setattr(gguf, "read_gguf", counted)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: NoTokenizer())
    return calls


def test_gguf_cache_is_keyed_by_path(tmp_path, gguf_cache):
    from workers.models.loader import resolve_model

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_tiny_gguf(tmp_path / "a" / "model.gguf", H=32)
    b = write_tiny_gguf(tmp_path / "b" / "model.gguf", H=64, I=128)
    dir_a, dir_b = resolve_model(str(a)), resolve_model(str(b))
    assert dir_a != dir_b and dir_a.name.startswith("model-")
    assert resolve_model(str(a)) == dir_a and len(gguf_cache) == 2  # converted once each
    assert load_config(dir_a)["hidden_size"] == 32 and load_config(dir_b)["hidden_size"] == 64


def test_concurrent_gguf_conversions_convert_once(tmp_path, gguf_cache):
    """Workers resolving one GGUF at once: one converts, the others wait and load its result."""
    from concurrent.futures import ThreadPoolExecutor

    from workers.models.loader import resolve_model

    path = write_tiny_gguf(tmp_path / "m.gguf")
    with ThreadPoolExecutor(3) as pool:
        dirs = list(pool.map(lambda _: resolve_model(str(path)), range(3)))
    assert len(set(dirs)) == 1 and len(gguf_cache) == 1
    assert len(list(iter_safetensors(dirs[0]))) == 2 * 9 + 3


def test_failed_gguf_conversion_leaves_nothing(tmp_path, gguf_cache, monkeypatch):
    from transformers import AutoTokenizer

    from workers.models.loader import resolve_model

    def fail(*args, **kwargs):
        raise ValueError("Cannot build a tokenizer from a GGUF file stating tokenizer None")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fail)
    # a GGUF that says it has a tokenizer (one without converts to ids-only)
    path = write_tiny_gguf(tmp_path / "m.gguf", metadata={"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="tokenizer"):
        resolve_model(str(path))
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []


def test_random_drafter_keeps_the_targets_weights(tmp_path, monkeypatch):
    """A `random` drafter shares the target's embedding and draws only its own weights: a random
    target is the same with the drafter as without (speculative against plain compares them)."""
    from speculative.config import EngineConfig
    from workers.model_runner import ModelRunner

    monkeypatch.setenv("EAGLESERVE_CACHE", str(tmp_path))
    targets = []
    for drafter in ("none", "random"):
        torch.manual_seed(0)
        cfg = EngineConfig(model="random:smollm2-135m", drafter=drafter, max_batch_size=1,
                           max_model_len=64, device="cpu", dtype="float32")  # fmt: skip
        targets.append(ModelRunner(cfg).target.state_dict())
    assert targets[0].keys() == targets[1].keys()
    assert all(torch.equal(targets[0][name], targets[1][name]) for name in targets[0])
