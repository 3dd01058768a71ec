"""Drafts that follow the grammar (workers/draft_grammar.py): forced tokens are the drafts, the
ranks' matchers come back to the output after every chain, greedy output stays plain decoding's
(a JSON schema, a regex and a tool call beside free rows, on SmolLM2), and more drafts are
accepted than with free drafts. The sampled distribution: test_structured.py's chi-square."""

import json
import pickle

import pytest
import torch
import xgrammar as xgr
from conftest import tiny_engine, tiny_prompts
from test_structured import raw_grammars

from speculative.config import SamplingParams, StructuredSpec
from speculative.engine.llm_engine import encode_prompt
from speculative.grammar import Grammars, PortableGrammar, tool_call_schema
from workers.draft_grammar import DraftGrammars

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


def bitmask(matcher: xgr.GrammarMatcher, vocab_size: int) -> list[int]:
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return mask[0].tolist()


def test_forced_tokens_are_proposed(tiny_dir, tiny_drafter_dir):
    """A regex that spells out its first letters: after the prefill the drafts are the forced
    letters (the random drafter would not guess them), so the verify steps inside them accept all
    K."""
    spec = StructuredSpec(kind="regex", spec="bcdefghij[a-z]+")
    params = SamplingParams(max_tokens=12, structured=spec)
    drafts = {}
    for follows in (True, False):
        engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, overlap=False)
        engine.scheduler.intake.grammars = raw_grammars(64, stop=63)
        runner = engine.executor
        if not follows:
            runner.draft_grammars = None
        request = engine.add_request(tiny_prompts(1, seed=3)[0], params)
        engine.step()  # the prefill: its first token and the drafts after it
        drafts[follows] = runner.state.drafts[request.slot, :3].tolist()
        engine.step(), engine.step()  # two verify steps inside the forced letters
        if follows:  # every draft accepted: K + 1 tokens a step
            assert request.num_verify_steps == 2 and request.num_verify_emitted == 8
        while engine.has_work:
            engine.step()
        assert letters(request.output_ids).startswith("bcdefghij")
    assert letters(drafts[True]) == "cde" and letters(drafts[False]) != "cde"


@pytest.mark.parametrize("ks", [(None, None, None), (1, 0, 2)])
def test_matchers_roll_back_to_the_output_and_output_is_plain(tiny_dir, tiny_drafter_dir, ks):
    """Random drafts inside a branching grammar get rejected; after every step each rank
    matcher allows what a fresh matcher after the output the plans sent allows, and the output
    (greedy, constrained rows beside a free one, overlapped) is plain decoding's. With per-row K
    (1 and 2 of 3) the chain leaves the constrained rows behind at depths past their K: their
    matchers come back too."""
    spec = StructuredSpec(kind="regex", spec="[a-p]{3}([q-z][a-d]|[e-h]{2})+")
    constrained = SamplingParams(max_tokens=24, structured=spec, stop_token_ids=[63])
    params = [constrained, SamplingParams(max_tokens=24), constrained]
    prompts = tiny_prompts(3, seed=21)
    outputs, checked = [], 0
    for drafter in ("none", tiny_drafter_dir):
        engine = tiny_engine(tiny_dir, drafter, k=3, overlap=True)
        grammars = raw_grammars(64, stop=63)
        engine.scheduler.intake.grammars = grammars
        if drafter != "none":
            params = [p.model_copy(update={"num_draft_tokens": k}) for p, k in zip(params, ks)]
        requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_work:
            engine.step()
            if drafter != "none":
                checked += check_matchers(engine, requests, grammars)
        outputs.append([r.output_ids for r in requests])
    assert outputs[0] == outputs[1]
    stats = engine.scheduler.stats
    assert checked > 0 and engine.executor.draft_grammars.num_steps > 0
    assert 0 < stats.num_draft_accepted < stats.num_draft_proposed  # some drafts rejected


def check_matchers(engine, requests, grammars: Grammars) -> int:
    """-> how many rank matchers were compared with a fresh one after the output sent."""
    matchers = engine.executor.draft_grammars.matchers
    compared = 0
    for r in requests:
        if r.slot in matchers and r.num_grammar_sent is not None and not r.is_finished:
            fresh = xgr.GrammarMatcher(grammars.compile(r.params.structured))
            assert all(fresh.accept_token(t) for t in r.output_ids[: r.num_grammar_sent])
            if fresh.is_terminated():
                continue
            assert bitmask(matchers[r.slot], 64) == bitmask(fresh, 64)
            compared += 1
    return compared


def test_a_pickled_grammar_loads_against_the_ranks_tokenizer(smollm2_dir, smollm2_engine):
    """Over Ray the plan carries the grammar's JSON; a rank deserializes it against the
    TokenizerInfo it builds from its own tokenizer, and follows the same masks."""
    tokenizer = smollm2_engine.tokenizer
    grammars = Grammars.for_tokenizer(tokenizer, 49152, {tokenizer.eos_token_id})
    compiled = grammars.compile(StructuredSpec(kind="json", spec=json.dumps(PERSON)))
    carried = pickle.loads(pickle.dumps(PortableGrammar(compiled)))
    assert carried.compiled is None
    rank = DraftGrammars(49152, torch.device("cpu"), smollm2_dir)
    loaded = xgr.GrammarMatcher(carried.resolve(rank._info))
    here = xgr.GrammarMatcher(compiled)
    for token in tokenizer.encode('{"name": "Ann', add_special_tokens=False):
        assert bitmask(loaded, 49152) == bitmask(here, 49152)
        assert loaded.accept_token(token) and here.accept_token(token)
    assert loaded.find_jump_forward_tokens() == here.find_jump_forward_tokens()


@pytest.fixture(scope="module")
def smollm2_speculative():
    from conftest import _smollm2

    return _smollm2("default", max_batch_size=8)


def smollm2_specs() -> list[StructuredSpec | None]:
    tool_call = tool_call_schema(WEATHER, "required")
    return [
        StructuredSpec(kind="json", spec=json.dumps(PERSON)),
        None,
        StructuredSpec(kind="regex", spec=r"\(\d{3}\) \d{3}-\d{4}"),
        StructuredSpec(kind="json", spec=json.dumps(tool_call)),
        None,
    ]


def test_greedy_smollm2_grammar_drafts_equal_plain_and_accept_more(
    smollm2_engine, smollm2_speculative
):
    questions = [
        "Describe a person as JSON.",
        "Say hello.",
        "What is your phone number?",
        "What is the weather in Paris?",
        "Name a colour.",
    ]
    prompts = [encode_prompt(smollm2_engine.tokenizer, q) for q in questions]
    params = [SamplingParams(max_tokens=40, structured=s) for s in smollm2_specs()]
    plain = [r.output_ids for r in smollm2_engine.generate(prompts, params)]
    engine = smollm2_speculative
    following = engine.generate(prompts, params)
    assert [r.output_ids for r in following] == plain
    rank = engine.executor.draft_grammars
    engine.executor.draft_grammars = None  # free drafts, as before
    free = engine.generate(prompts, params)
    engine.executor.draft_grammars = rank
    assert [r.output_ids for r in free] == plain
    constrained = [i for i, p in enumerate(params) if p.structured is not None]
    accepted = [sum(rs[i].acceptance_length for i in constrained) for rs in (following, free)]
    print("constrained tokens/step, drafts following / free:", accepted)
    assert accepted[0] > accepted[1]


def test_grammar_drafts_with_per_row_k_equal_plain(smollm2_engine, smollm2_speculative):
    """Constrained rows among rows of K 0, 1, 2 and the engine's: each depth drafts a prefix of
    the K-sorted rows, and the constrained ones' masks follow that order."""
    questions = ["Describe a person as JSON.", "Say hello.", "What is your phone number?",
                 "What is the weather in Paris?", "Name a colour."]  # fmt: skip
    prompts = [encode_prompt(smollm2_engine.tokenizer, q) for q in questions]
    ks = [1, 0, None, 2, 3]
    plain_params = [SamplingParams(max_tokens=32, structured=s) for s in smollm2_specs()]
    plain = [r.output_ids for r in smollm2_engine.generate(prompts, plain_params)]
    params = [p.model_copy(update={"num_draft_tokens": k}) for p, k in zip(plain_params, ks)]
    mixed = smollm2_speculative.generate(prompts, params)
    assert [r.output_ids for r in mixed] == plain
    constrained = [i for i, p in enumerate(params) if p.structured is not None and ks[i] != 0]
    assert all(mixed[i].acceptance_length > 1 for i in constrained)
