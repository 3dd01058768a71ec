"""The target model against Hugging Face transformers: weights (GGUF conversion), logits, and greedy
generation of the real SmolLM2-135M token for token."""
import pytest
import torch

from conftest import run_to_completion, tiny_engine, tiny_prompts, write_tiny_llama
from speculative.config import SamplingParams
from workers.attention import ForwardBatch, allocate_kv_cache
from workers.llama import Llama, LlamaConfig
from workers.loader import iter_safetensors, load_config, load_target_weights


def our_llama(model_dir, max_len: int = 128) -> Llama:
    """Our target on one slot, with its KV cache attached."""
    cfg = LlamaConfig.from_hf(load_config(model_dir))
    model = Llama(cfg, max_positions=max_len, aux_layer_ids=())
    load_target_weights(model, model_dir)
    cache = allocate_kv_cache(cfg.num_hidden_layers, 1, max_len, cfg.num_key_value_heads, cfg.head_dim,
                              torch.float32, "cpu")
    for layer, c in zip(model.layers, cache):
        layer.self_attn.cache = c
    return model


def full_forward_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    T = len(ids)
    positions = torch.arange(T).unsqueeze(0)
    batch = ForwardBatch(torch.tensor([0]), positions, torch.zeros(1, T, dtype=torch.long), positions, T)
    hidden, _ = model(torch.tensor([ids]), batch)
    return model.logits(hidden)[0]


def test_gqa_attention_equals_folded(tmp_path, monkeypatch):
    """Both ways of running the attention (GQA from strided queries, or the query heads folded into
    the query length) give the same logits, for one and for several tokens per row, over cached keys."""
    import workers.attention
    model = our_llama(write_tiny_llama(tmp_path / "m", num_heads=4, num_kv_heads=2, seed=5))
    for layer in model.layers:  # 2 slots + dummy, random: rows past each position must stay masked
        layer.self_attn.cache = torch.randn(2, 3, *layer.self_attn.cache.shape[2:])
    ids = torch.tensor(tiny_prompts(2, seed=3, min_len=5, max_len=5))
    logits = {}
    for gqa in (True, False):
        monkeypatch.setattr(workers.attention, "use_gqa", lambda *args, gqa=gqa: gqa)
        for T in (5, 1):
            positions = torch.tensor([[7], [11]]) + torch.arange(T)
            batch = ForwardBatch(torch.tensor([0, 1]), positions, torch.tensor([[0], [1]]).expand(2, T), positions, 32)
            hidden, _ = model(ids[:, :T], batch)
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
    one. The 2-layer target is shallower than the default aux layers (2, L/2, L-3): plain runs anyway."""
    from transformers import AutoModelForCausalLM
    tiny_dir = write_tiny_llama(tmp_path / "m", tie=tie, num_layers=layers, seed=12)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    prompts = tiny_prompts(6, seed=4)
    requests = run_to_completion(tiny_engine(tiny_dir, max_batch_size=4), prompts,
                                 SamplingParams(max_tokens=32, ignore_eos=True), [0, 0, 1, 2, 6, 7])
    for prompt, r in zip(prompts, requests):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert r.output_ids == out[0, len(prompt):].tolist()


def test_gguf_conversion_matches_hf_dequantization(smollm2_dir, hf_smollm2):
    """Our GGUF -> safetensors conversion (dequantize + undo llama.cpp's q/k row permutation) gives
    exactly the tensors Hugging Face's own GGUF loader produces."""
    hf_state = hf_smollm2.state_dict()
    names = 0
    for name, tensor in iter_safetensors(smollm2_dir):
        torch.testing.assert_close(tensor, hf_state[name], rtol=0, atol=0, msg=name)
        names += 1
    assert names == 30 * 9 + 2   # tied embeddings: no lm_head.weight


@pytest.fixture(scope="module")
def hf_greedy_64(hf_smollm2, smollm2_prompts, smollm2_engine):
    """HF `generate`, greedy, 64 new tokens, batches of 10 left-padded prompts (padding moves HF's
    numbers by float noise only; the near-tie rule covers what that could flip)."""
    eos = sorted(smollm2_engine.scheduler.eos_token_ids)
    outs = []
    with torch.no_grad():
        for start in range(0, len(smollm2_prompts), 10):
            batch = smollm2_prompts[start:start + 10]
            T = max(map(len, batch))
            ids = torch.tensor([[eos[0]] * (T - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in batch])
            out = hf_smollm2.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                                      eos_token_id=eos, pad_token_id=eos[0])[:, T:].tolist()
            outs += [o[:next((i for i, t in enumerate(o) if t in eos), len(o))] for o in out]
    return outs


def test_smollm2_greedy_matches_hf_generate(smollm2_prompts, smollm2_greedy_64, hf_greedy_64, smollm2_near_tie):
    """20 benchmark prompts with the chat template, run as ONE batch of different prompt lengths
    (fp32, CPU), against HF generate from the GGUF file: equal, or the first difference a near-tie."""
    assert len(smollm2_prompts) == 20 and len({len(p) for p in smollm2_prompts}) > 10
    for prompt, ours, ref in zip(smollm2_prompts, smollm2_greedy_64, hf_greedy_64):
        smollm2_near_tie(prompt, ours, ref)
    print(f"{sum(o == r for o, r in zip(smollm2_greedy_64, hf_greedy_64))}/20 identical")
