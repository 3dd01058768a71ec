"""The model's generation_config.json as the defaults of a request's unset sampling fields (vLLM's
`--generation-config auto`, the default), against `vllm` (none): the merge field by field, then
over real HTTP with the official openai client, a tiny random model (with a random drafter) whose
config makes an unset request greedy with a repetition penalty and 6 tokens, served both ways
side by side."""

import glob
import json

import openai
import pytest
import ray
from conftest import tiny_engine, write_random_drafter
from pydantic import ValidationError
from ray import serve
from serve_app import start_app, stop_app
from tiny_models import tiny_llama

from deployments.config import ServeConfig
from deployments.generation_config import generation_defaults
from deployments.protocol import ChatCompletionRequest
from deployments.server import build_app
from speculative.config import SamplingParams

MODEL = "tiny"
GENERATION = {
    "temperature": 0.0,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.5,
    "max_new_tokens": 6,
    "do_sample": True,  # vLLM reads the sampling values alone, as here
    "bos_token_id": 1,
}
DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.5}
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_llama(tmp_path_factory.mktemp("gen") / "tiny", layers=4, max_positions=256)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


# ---- the merge ----


def test_the_defaults_auto_vllm_or_a_directory(model_dir, tmp_path):
    assert generation_defaults("auto", model_dir) == DEFAULTS | {"max_tokens": 6}
    assert generation_defaults("vllm", model_dir) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"min_p": 0.1, "top_k": None}))
    assert generation_defaults(str(tmp_path), model_dir) == {"min_p": 0.1}
    assert generation_defaults("auto", tmp_path / "none") == {}  # a model without one
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path / "none"), model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p: "):
        generation_defaults(str(tmp_path), model_dir)
    with pytest.raises(ValidationError, match="auto, vllm or a directory"):
        ServeConfig(generation_config=str(tmp_path / "none"))


def _params(defaults: dict, **fields) -> SamplingParams:
    req = ChatCompletionRequest(model=MODEL, messages=CHAT, **fields)
    return req.sampling_params(50, defaults)


def test_unset_fields_take_the_defaults_and_the_requests_own_win(model_dir):
    defaults = generation_defaults("auto", model_dir)
    got = _params(defaults)
    assert {k: getattr(got, k) for k in DEFAULTS} == DEFAULTS and got.min_p == 0.0
    own = _params(defaults, temperature=0.7, top_k=0, repetition_penalty=1.0)
    assert (own.temperature, own.top_k, own.repetition_penalty, own.top_p) == (0.7, 0, 1.0, 0.9)
    assert _params(defaults, temperature=None).temperature == 0.0  # null: unset, as in vLLM
    assert _params(defaults, temperature=1.2, top_p=0).is_greedy  # top_p 0 stays greedy
    assert _params({}) == _params(generation_defaults("vllm", model_dir))
    assert _params({}).temperature == 1.0 and _params({}).repetition_penalty == 1.0


# ---- over HTTP: auto at /, vllm at /vllm ----


@pytest.fixture(scope="module")
def clients(model_dir):
    engine = {
        "model": str(model_dir),
        "drafter": str(write_random_drafter(model_dir.parent / "drafter", model_dir)),
        "num_draft_tokens": 3,
        "max_batch_size": 4,
        "max_model_len": MAX_MODEL_LEN,
        "device": "cpu",
        "dtype": "float32",
    }
    url = start_app(ServeConfig(engine=engine, served_model_name=MODEL), num_cpus=3)
    plain = ServeConfig(engine=engine, served_model_name=MODEL, generation_config="vllm")
    serve.run(build_app(plain), name="vllm-defaults", route_prefix="/vllm")
    yield {
        name: openai.OpenAI(base_url=f"{url}{prefix}/v1", api_key="x", max_retries=0, timeout=120)
        for name, prefix in (("auto", ""), ("vllm", "/vllm"))
    }
    stop_app()


def chat(client, **kw):
    kw["extra_body"] = {"ignore_eos": True} | kw.get("extra_body", {})
    return client.chat.completions.create(model=MODEL, messages=CHAT, **kw)


def test_an_unset_request_gets_the_models_defaults(clients, model_dir):
    """Greedy with the penalty, 6 tokens: what the same request asks for in so many words, and
    token for token plain decoding's (the server speculates), unlike the request without the
    penalty or `--generation-config vllm`'s sampled reply."""
    auto = clients["auto"]
    unset = chat(auto)
    explicit = chat(auto, temperature=0, max_tokens=6, extra_body={"repetition_penalty": 1.5})
    assert unset.choices[0].message.content == explicit.choices[0].message.content
    assert unset.usage.completion_tokens == 6
    no_penalty = chat(auto, max_tokens=6, extra_body={"repetition_penalty": 1.0})
    assert no_penalty.choices[0].message.content != unset.choices[0].message.content
    engine = tiny_engine(model_dir, max_model_len=MAX_MODEL_LEN)
    text = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)  # as the server encodes it
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, **DEFAULTS))
    assert unset.choices[0].message.content == engine.tokenizer.decode(
        plain.output_ids, skip_special_tokens=True
    )
    vllm = chat(clients["vllm"], seed=5, max_tokens=6)
    assert vllm.choices[0].message.content != unset.choices[0].message.content


def test_vllm_keeps_vllms_defaults(clients):
    """Temperature 1, no cut, no penalty (the auto server's reply to those values, same seed),
    and max_tokens the rest of the context."""
    own = {"top_k": 0, "repetition_penalty": 1.0}
    sampled = chat(clients["auto"], seed=5, max_tokens=6, temperature=1, top_p=1, extra_body=own)
    vllm = chat(clients["vllm"], seed=5, max_tokens=6)
    assert vllm.choices[0].message.content == sampled.choices[0].message.content
    whole = chat(clients["vllm"], seed=5)
    assert whole.usage.completion_tokens == MAX_MODEL_LEN - whole.usage.prompt_tokens


def test_the_start_log_names_the_defaults(clients):
    """vLLM's warning, in the ingress's log of the auto app only."""
    logs = ray._private.worker._global_node.get_logs_dir_path()
    text = {
        app: "".join(open(f).read() for f in glob.glob(f"{logs}/serve/*{app}*OpenAIIngress*"))
        for app in ("eagleserve", "vllm-defaults")
    }
    line = "Default sampling parameters have been overridden by the model's generation config"
    assert line in text["eagleserve"] and "'repetition_penalty': 1.5" in text["eagleserve"]
    assert text["vllm-defaults"] and line not in text["vllm-defaults"]
