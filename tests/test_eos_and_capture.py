"""Engine behaviour the other tests could not see: EOS reached by greedy decoding (kept as a
generated token; held back by min_tokens even under ignore_eos), max_tokens falling inside a step
that emits several tokens, and which layers' residual stream feeds the drafter."""

import json

import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts, write_random_drafter
from conftest import write_tiny_llama as write_llama

from speculative.config import SamplingParams

PROMPT = tiny_prompts(1, seed=13)[0]
FULL = 30  # tokens of the plain greedy output the EOS is picked from


def hf_greedy(model_dir, prompt, params: SamplingParams, eos: int) -> tuple[list[int], list]:
    """Greedy decoding from Hugging Face logits (fp32), EOS masked before min_tokens and ending the
    output (as its last token) unless ignore_eos -> (tokens, their log-probabilities)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out, logprobs = [], []
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        if len(out) < params.min_tokens:
            logits[eos] = float("-inf")
        out.append(int(logits.argmax()))
        logprobs.append(float(torch.log_softmax(logits, -1)[out[-1]]))
        if out[-1] == eos and not params.ignore_eos:
            break
    return out, logprobs


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, tiny_dir):
    """tiny_dir's weights with an EOS that its greedy output reaches at position j (its first
    time there) -> (directory, drafter directory, j, the EOS id)."""
    full = run_to_completion(
        tiny_engine(tiny_dir), [PROMPT], SamplingParams(max_tokens=FULL, ignore_eos=True)
    )[0].output_ids
    j = next(i for i in range(FULL // 3, FULL) if full[i] not in full[:i])
    path = tmp_path_factory.mktemp("eos")
    model = write_llama(path / "target", eos_token_id=full[j])
    return model, write_random_drafter(path / "drafter", model), j, full[j]


@pytest.mark.parametrize("speculative", [False, True])
def test_eos_is_a_generated_token(eos_model, speculative):
    """The output ends with the EOS, with its log-probability, as in vLLM (lm-eval reads the
    continuation's log-probabilities as token_logprobs[ctxlen:-1])."""
    model, drafter, j, eos = eos_model
    engine = tiny_engine(model, drafter if speculative else "none")
    params = SamplingParams(max_tokens=FULL, logprobs=0)
    outputs = []
    engine.add_request(PROMPT, params)
    while engine.has_work:
        outputs += engine.step()
    ids = [t for o in outputs for t in o.new_token_ids]
    logprobs = [lp for o in outputs for lp, _ in o.logprobs]
    ref, ref_logprobs = hf_greedy(model, PROMPT, params, eos)
    assert ids == ref and len(ids) == j + 1 and ids[-1] == eos
    assert outputs[-1].finish_reason == "stop"
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_min_tokens_holds_back_eos(eos_model, speculative, ignore_eos):
    """min_tokens keeps EOS from being chosen before it, under ignore_eos too (as vLLM): the
    output differs from the plain one right where that one had the EOS."""
    model, drafter, j, eos = eos_model
    params = SamplingParams(max_tokens=FULL, min_tokens=j + 3, ignore_eos=ignore_eos)
    ref, _ = hf_greedy(model, PROMPT, params, eos)
    assert eos not in ref[: j + 3] and len(ref) > j + 3
    engine = tiny_engine(model, drafter if speculative else "none")
    r = run_to_completion(engine, [PROMPT], params)[0]
    assert r.output_ids == ref
    assert r.finish_reason == ("stop" if ref[-1] == eos and not ignore_eos else "length")


def test_max_tokens_inside_a_multi_token_step(tiny_dir, tiny_drafter_dir):
    """A limit that falls inside a step emitting several tokens cuts the output (and its
    log-probabilities) there."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1)
    prompts = tiny_prompts(6, seed=5)
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=4, prompt_lookup=1.0)
    cuts = []  # (prompt, output before the step, tokens the step emitted)
    for prompt in prompts:
        engine.add_request(prompt, params)
        done = 0
        while engine.has_work:
            for out in engine.step():
                if len(out.new_token_ids) > 1 and done > 0:
                    cuts.append((prompt, done, len(out.new_token_ids)))
                done += len(out.new_token_ids)
    assert cuts, "no step emitted several tokens"
    for prompt, before, emitted in cuts[:3]:
        full = run_to_completion(engine, [prompt], params)[0].output_ids
        limit = params.model_copy(update={"max_tokens": before + emitted - 1})
        outputs = []
        engine.add_request(prompt, limit)
        while engine.has_work:
            outputs += engine.step()
        ids = [t for o in outputs for t in o.new_token_ids]
        assert ids == full[: before + emitted - 1] and outputs[-1].finish_reason == "length"
        assert len(outputs[-1].new_token_ids) == emitted - 1  # the same step, cut
        assert all(len(o.logprobs) == len(o.new_token_ids) for o in outputs)


def engine_target(engine) -> torch.nn.Module:
    """The engine's target model, whose forward returns (hidden, captured aux states): the one
    internal these tests read (repoint it when the model runner moves)."""
    return engine.executor.target


@pytest.mark.parametrize("aux_ids", [None, [1, 3, 6]])
def test_captured_aux_states_are_hf_hidden_states(tmp_path, aux_ids):
    """The drafter's features are the residual stream entering its configured layers (EAGLE-3's
    default: 2, L/2, L-3), slice by slice equal to transformers' hidden_states[i]."""
    from transformers import AutoModelForCausalLM

    layers = 8
    model = write_llama(tmp_path / "target", num_layers=layers)
    drafter = write_random_drafter(tmp_path / "drafter", model)
    if aux_ids is not None:
        config = json.loads((drafter / "config.json").read_text())
        config["eagle_aux_hidden_state_layer_ids"] = aux_ids
        (drafter / "config.json").write_text(json.dumps(config))
    expected = aux_ids or [2, layers // 2, layers - 3]
    engine = tiny_engine(model, drafter)
    captured = []
    engine_target(engine).register_forward_hook(lambda m, a, out: captured.append(out[1].clone()))
    run_to_completion(engine, [PROMPT], SamplingParams(max_tokens=1))
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    aux = captured[0][0, : len(PROMPT)]  # the prefill's row
    H = hidden[0].shape[-1]
    assert aux.shape[-1] == len(expected) * H
    for j, layer in enumerate(expected):
        got = aux[:, j * H : (j + 1) * H]
        torch.testing.assert_close(got, hidden[layer][0], rtol=0, atol=1e-4)
        assert (got - hidden[layer + 1][0]).abs().max() > 0.1  # a neighbour would not pass
