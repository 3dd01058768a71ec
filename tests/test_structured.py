"""Structured outputs in the engine (speculative/grammar.py): the masks follow the drafts exactly,
greedy constrained output with a drafter is token for token the output without one, sampled
constrained output has the masked, renormalised distribution (chi-square against the exact joint
of the first three tokens), a constrained request never has two steps in flight while the
unconstrained ones beside it keep theirs, and a grammar that waits for the reasoning's end."""

import json
import re

import jsonschema
import pytest
import test_lossless
import torch
import xgrammar as xgr
from conftest import replay_graphs_on_cpu, run_to_completion, tiny_engine, tiny_prompts
from test_lossless import PROMPT, V16, _engine, chi2_pvalue, oracle_drafts, sample_first_three

from speculative.config import SamplingParams, StructuredSpec
from speculative.draft_tree import sibling_node
from speculative.engine.llm_engine import encode_prompt
from speculative.grammar import GrammarError, Grammars, tool_call_schema
from speculative.reasoning_grammar import MarkerTokens, ReasoningGrammar

v16_dirs = test_lossless.v16_dirs  # the chi-square machinery's tiny model and drafter
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def raw_grammars(vocab_size: int, stop: int) -> Grammars:
    """Grammars over a tokenizer-less tiny model: token i is the letter 'a' + i."""
    vocab = [chr(ord("a") + i) for i in range(vocab_size)]
    info = xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[stop]
    )
    return Grammars(info)


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


def allowed_after(grammars: Grammars, spec: StructuredSpec, prefix: list[int]) -> torch.Tensor:
    """The tokens a fresh matcher allows after `prefix`, as a bool vector [V]."""
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    assert all(matcher.accept_token(t) for t in prefix)
    mask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return unpack(mask[0], grammars.vocab_size)


def unpack(row: torch.Tensor, V: int) -> torch.Tensor:
    return (((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:V]) == 1


# ---- the host side ----

TREE = StructuredSpec(kind="regex", spec="(a[b-h]|b[c-k]|[c-h][a-o])[a-d]+")


def test_masks_follow_drafts_and_siblings_then_roll_back():
    grammars = raw_grammars(V16, stop=15)
    request = grammars.matcher(TREE)
    assert request.accept([1])  # "b"
    K, M = 3, 1
    drafts, siblings = [4, 0, 2], [[2, 3, 5]]  # "e" ok, "a" ok, "c" ok; siblings "c", "d", "f"
    rows = torch.zeros(1 + K * (M + 1), 1, dtype=torch.int32)
    request.fill(rows, drafts, siblings)
    for node, path in [(0, []), (1, [4]), (2, [4, 0]), (3, [4, 0, 2]), (4, [2]), (5, [4, 3])]:
        assert torch.equal(unpack(rows[node], V16), allowed_after(grammars, TREE, [1, *path]))
    assert unpack(rows[6], V16).all()  # sibling "f" after "e" is forbidden: no row of its own
    request.fill(rows, [14, 0, 0], [[0, 0, 0]])  # "o" and "a" are forbidden after "b"
    assert not unpack(rows[0], V16)[14] and not unpack(rows[0], V16)[0]
    assert all(unpack(rows[i], V16).all() for i in range(1, 7))  # cut: rows no token reads
    # rolled back: the matcher is where the output left it
    assert torch.equal(unpack(_row0(request), V16), allowed_after(grammars, TREE, [1]))


def _row0(request) -> torch.Tensor:
    rows = torch.zeros(1, 1, dtype=torch.int32)
    request.fill(rows, [], [])
    return rows[0]


# ---- a grammar after the reasoning (speculative/reasoning_grammar.py) ----


class Spelled:
    """A tokenizer's decoding over a fixed vocabulary (the raw grammars' letters, and more)."""

    def __init__(self, vocab: list[str]):
        self.vocab = vocab

    def __len__(self):
        return len(self.vocab)

    def decode(self, ids):
        return "".join(self.vocab[t] for t in ids)

    def batch_decode(self, rows):
        return [self.decode(ids) for ids in rows]

    def convert_ids_to_tokens(self, ids):
        return [self.vocab[t] for t in ids]


def test_reasoning_masks_free_until_the_marker_then_the_grammars():
    """Marker "bc": the rows up to the draft that completes it are the reasoning's (free, but for
    "cd", which would end it and begin the content at once), the rows after it the grammar's
    from its start, chain and sibling alike; the grammar sees only the tokens after the marker."""
    vocab = [chr(ord("a") + i) for i in range(14)] + ["cd", "</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[15])
    grammars, spelled = Grammars(info), Spelled(vocab)
    spec = StructuredSpec(kind="regex", spec="[d-f]+")
    gate = ReasoningGrammar(grammars.matcher(spec), spelled, MarkerTokens(spelled, "bc", 16))
    assert gate.accept([0])  # "a": reasoning
    K, M = 3, 1
    rows = torch.zeros(1 + K * (M + 1), 1, dtype=torch.int32)
    gate.fill(rows, [1, 2, 3], [[4, 14, 5]])  # chain "b", "c", "d"; siblings "e", "cd", "f"
    free = torch.ones(16, dtype=torch.bool)
    assert torch.equal(unpack(rows[0], 16), free)
    assert torch.equal(unpack(rows[1], 16), free & (torch.arange(16) != 14))  # after "ab"
    assert torch.equal(unpack(rows[2], 16), allowed_after(grammars, spec, []))  # after "abc"
    assert torch.equal(unpack(rows[3], 16), allowed_after(grammars, spec, [3]))
    assert torch.equal(unpack(rows[sibling_node(K, 0, 0)], 16), free)  # after "ae"
    assert torch.equal(unpack(rows[sibling_node(K, 0, 2)], 16), allowed_after(grammars, spec, [5]))
    assert gate.accept([1, 2, 3])  # "b", "c" end the reasoning; "d" is the grammar's
    gate.fill(rows, [], [])
    assert torch.equal(unpack(rows[0], 16), allowed_after(grammars, spec, [3]))


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def thinking_prompt(tokenizer) -> list[int]:
    """A reply that starts in reasoning: the prompt opens the <think> (SmolLM2 never closes it on
    its own: THINK_BIAS makes it, a few tokens in)."""
    question = "What is 2+2? First think step by step inside <think> </think> tags, then answer."
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "<think>"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_smollm2_grammar_after_reasoning_with_drafter_equals_without(
    smollm2_engine, smollm2_speculative
):
    """The reasoning is the free greedy output's, up to the token that completes </think> (the
    free one, >", would begin the content); the JSON after it follows the schema; with the
    drafter, token for token the output without one."""
    tokenizer = smollm2_engine.tokenizer
    prompt = thinking_prompt(tokenizer)
    bias = {tokenizer.encode("</", add_special_tokens=False)[0]: 4}
    free = SamplingParams(max_tokens=40, logit_bias=bias)
    spec = StructuredSpec(kind="json", spec=json.dumps(ANSWER))
    gated = free.model_copy(update={"structured": spec, "reasoning_end": "</think>"})
    [plain] = smollm2_engine.generate([prompt], gated)
    accepted = smollm2_speculative.scheduler.stats.num_draft_accepted
    [speculative] = smollm2_speculative.generate([prompt], gated)
    assert speculative.output_ids == plain.output_ids
    assert smollm2_speculative.scheduler.stats.num_draft_accepted > accepted
    [unconstrained] = smollm2_engine.generate([prompt], free)
    pieces = [tokenizer.decode([t]) for t in plain.output_ids]
    end = pieces.index("think") + 1  # the token that completes the marker
    assert plain.output_ids[:end] == unconstrained.output_ids[:end]
    assert pieces[end] == ">" and tokenizer.decode([unconstrained.output_ids[end]]) == '>"'
    reasoning, _, content = tokenizer.decode(plain.output_ids, skip_special_tokens=True).partition(
        "</think>"
    )
    assert "Step 1" in reasoning
    jsonschema.validate(json.loads(content), ANSWER)


def test_bad_constraints_name_the_problem_and_compiles_are_cached(smollm2_engine):
    scheduler = smollm2_engine.scheduler
    bad = {
        StructuredSpec(kind="json", spec='{"type": "foo"}'): 'Unsupported type "foo"',
        StructuredSpec(kind="regex", spec="(ab"): "parenthesis is not closed",
        StructuredSpec(kind="grammar", spec="root ::= foo"): 'Rule "foo" is not defined',
        StructuredSpec(kind="regex", spec="a{50000}"): "exceeds the limit",
    }
    for spec, reason in bad.items():
        with pytest.raises(Exception, match=reason):
            scheduler.validate("x", [1, 2], SamplingParams(structured=spec))
    good = StructuredSpec(kind="json", spec=json.dumps(PERSON))
    scheduler.validate("x", [1, 2], SamplingParams(structured=good))
    assert scheduler.intake.grammars.compile(good) is scheduler.intake.grammars.compile(good)
    with pytest.raises(GrammarError):
        scheduler.intake.grammars.compile(next(iter(bad)))


def test_tool_call_schema_forces_valid_calls():
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": PERSON}},
        {"type": "function", "function": {"name": "ping"}},
    ]
    named = tool_call_schema(tools, {"type": "function", "function": {"name": "ping"}}, False)
    jsonschema.validate([{"name": "ping", "arguments": {}}], named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], named)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel calls
        jsonschema.validate([{"name": "ping", "arguments": {}}] * 2, named)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_schema(tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="at least one function"):
        tool_call_schema([], "required")


# ---- greedy: with a drafter, token for token the output without one ----


def test_greedy_tiny_constrained_with_drafter_equals_without(tiny_dir, tiny_drafter_dir):
    spec = StructuredSpec(kind="regex", spec="[a-h][c-z]{2}(ab|[d-p]{3})+[q-z]{4}")
    constrained = SamplingParams(max_tokens=30, structured=spec, stop_token_ids=[63])
    params = [constrained, SamplingParams(max_tokens=30), constrained]  # one free beside them
    prompts = tiny_prompts(3, seed=11)
    outputs = []
    for drafter, overlap in [("none", False), (tiny_drafter_dir, True), (tiny_drafter_dir, False)]:
        engine = tiny_engine(tiny_dir, drafter, k=3, overlap=overlap)
        engine.scheduler.intake.grammars = raw_grammars(64, stop=63)
        requests = run_to_completion(engine, prompts, params, [0, 0, 2])
        outputs.append([r.output_ids for r in requests])
    assert outputs[0] == outputs[1] == outputs[2]
    for ids in outputs[0][0], outputs[0][2]:  # the grammar held: it ends at its stop token
        text = "".join(chr(ord("a") + t) for t in ids[:-1])
        assert ids[-1] == 63 and re.fullmatch(spec.spec, text), text


def smollm2_constrained(engine, prompts) -> list[list[int]]:
    specs = [
        StructuredSpec(kind="json", spec=json.dumps(PERSON)),
        StructuredSpec(kind="json_object"),
        StructuredSpec(kind="regex", spec=r"\d{3}-\d{4}"),
        StructuredSpec(kind="choice", choices=("positive", "negative")),
        None,
    ]
    params = [SamplingParams(max_tokens=48, structured=s) for s in specs]
    return [r.output_ids for r in engine.generate(prompts[: len(params)], params)]


@pytest.fixture(scope="module")
def smollm2_questions(smollm2_engine):
    questions = [
        "Describe a person as JSON.",
        "Give me a JSON object about a cat.",
        "What is your phone number?",
        "Is this review positive or negative: great food!",
        "Say hello.",
    ]
    return [encode_prompt(smollm2_engine.tokenizer, q) for q in questions]


@pytest.fixture(scope="module")
def smollm2_speculative():
    from conftest import _smollm2

    return _smollm2("default")


def test_greedy_smollm2_constrained_with_drafter_equals_without(
    smollm2_engine, smollm2_questions, smollm2_speculative
):
    plain = smollm2_constrained(smollm2_engine, smollm2_questions)
    speculative = smollm2_speculative
    assert smollm2_constrained(speculative, smollm2_questions) == plain
    assert speculative.scheduler.stats.num_draft_accepted > 0
    decode = smollm2_engine.tokenizer.decode
    person = json.loads(decode(plain[0], skip_special_tokens=True))
    jsonschema.validate(person, PERSON)
    assert decode(plain[1]).startswith("{")  # any JSON object (this one reaches max_tokens)
    assert decode(plain[3], skip_special_tokens=True) in ("positive", "negative")


# ---- overlap: a constrained request waits for its results, the others do not ----


def test_constrained_request_overlaps_with_late_masks(tiny_dir, tiny_drafter_dir):
    """With overlap a constrained request is in every step, as a free one is: a plan holds it
    while its last step is in flight, and its masks follow once that step is processed
    (LateGrammar), so its output, greedy, is the one without overlap."""
    spec = StructuredSpec(kind="regex", spec="[a-p]{3}([q-z][a-d]|[e-h]{2})+")
    params = [SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=40, structured=spec, stop_token_ids=[63])]  # fmt: skip
    outputs = []
    for overlap in (False, True):
        engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, overlap=overlap)
        engine.scheduler.intake.grammars = raw_grammars(64, stop=63)
        plans, execute = [], engine.executor.execute
        engine.executor.execute = lambda plan, ex=execute, seen=plans: seen.append(plan) or ex(plan)
        free, constrained = run_to_completion(engine, tiny_prompts(2, seed=4), params)
        outputs.append(constrained.output_ids)
    assert outputs[0] == outputs[1] and re.fullmatch(spec.spec, letters(outputs[1][:-1]))
    plans = list({p.step_id: p for p in plans}.values())  # a deferred step executes again
    slot = plans[0].slots[1]
    with_it = [p for p in plans if slot in p.slots]
    assert len(with_it) == constrained.num_verify_steps + 1  # the prefill, then every verify
    late = [p for p in with_it if p.late_grammar_rows]
    assert len(late) >= len(with_it) - 2  # all but the prefill and the first verify


# ---- sampled: the masked, renormalised distribution ----


def masked_joint(model_dir, grammars: Grammars, spec: StructuredSpec):
    """P(t1, t2, t3) [V, V, V] at temperature 1 under the grammar, and the conditionals, from a
    Hugging Face forward of every prefix and a fresh matcher's allowed tokens after it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def next_probs(prefixes):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].double()
        probs = torch.softmax(logits, -1)
        for row, prefix in enumerate(prefixes):
            matcher = xgr.GrammarMatcher(grammars.compile(spec))
            if all(matcher.accept_token(t) for t in prefix):
                probs[row] *= allowed_after(grammars, spec, prefix)
            else:
                probs[row] = 0.0
        return probs / probs.sum(-1, keepdim=True).clamp(min=1e-300)

    p1 = next_probs([[]])[0]
    p2 = next_probs([[a] for a in range(V16)])
    p3 = next_probs([[a, b] for a in range(V16) for b in range(V16)]).view(V16, V16, V16)
    return p1[:, None, None] * p2[:, :, None] * p3, (p2, p3)


SAMPLED = SamplingParams(temperature=1.0, max_tokens=3, structured=TREE)


def sample_constrained(v16_dirs, drafts: str, k: int, siblings: int):
    grammars = raw_grammars(V16, stop=15)
    joint, conditionals = masked_joint(v16_dirs[0], grammars, TREE)
    engine = _engine(v16_dirs, drafts != "none", k, siblings=siblings)
    engine.scheduler.intake.grammars = grammars
    oracle = (lambda _: set_oracle_drafts(engine, conditionals)) if drafts == "oracle" else None
    counts = sample_first_three(engine, SAMPLED, after_step=oracle)
    draft_grammars = engine.executor.draft_grammars  # drafts that follow the grammar
    return chi2_pvalue(counts, joint), engine.scheduler.stats, draft_grammars


def set_oracle_drafts(engine, conditionals) -> None:
    """test_lossless's oracle drafts (likely under the masked tables, so often accepted), written
    on the device and told to the host's grammar, which builds the next masks along them."""
    runner, K = engine.executor, engine.executor.K
    live = [
        r for r in engine.scheduler.running.values() if not r.is_finished and r.slot is not None
    ]
    for r in live:
        r.drafts = oracle_drafts(conditionals, r.output_ids, K, runner.M)
    if live:
        slots = torch.tensor([r.slot for r in live])
        runner.state.drafts[slots, :K] = torch.tensor([r.drafts[0] for r in live])
        if runner.M:
            runner.state.siblings[slots, :, :K] = torch.tensor([r.drafts[1] for r in live])


@pytest.mark.parametrize(
    "drafts, k, siblings",
    [("none", 1, 0), ("random", 3, 0), ("random", 2, 1), ("oracle", 3, 0), ("oracle", 2, 1)],
)
def test_sampled_constrained_distribution_is_the_masked_one(v16_dirs, drafts, k, siblings):
    """The "random" drafts: the drafter's, which follow the grammar (workers/draft_grammar.py)."""
    p_value, stats, draft_grammars = sample_constrained(v16_dirs, drafts, k, siblings)
    print(f"chi-square p-value {p_value:.3g}")
    assert p_value > 1e-3
    if drafts == "oracle":
        assert stats.accepted_at[0] > 0.3 * stats.num_verify_rows
    if drafts == "random":
        assert draft_grammars.num_steps > 0


def test_sampled_constrained_mixed_k_in_graphs_is_the_masked_one(v16_dirs):
    """Rows of K 0, 1, 2, 3 and auto sampled in one batch under the grammar, the drafts following
    it, each verify replaying the target pass's graph at K = 3 (padded: each row's limit stops
    acceptance at its own K; CPU stand-in): still the masked distribution."""
    grammars = raw_grammars(V16, stop=15)
    joint, _ = masked_joint(v16_dirs[0], grammars, TREE)
    config = dict(max_batch_size=500, max_model_len=128, max_num_batched_tokens=4096)
    engine = tiny_engine(*v16_dirs, k=3, overlap=False, **config)  # a cache the graphs cover
    engine.scheduler.intake.grammars = grammars
    graphs = replay_graphs_on_cpu(engine.executor, "target_pass", "draft_depth")
    ks = [0, 1, 2, 3, "auto"]
    counts = sample_first_three(
        engine, SAMPLED, per_seed=lambda s: {"num_draft_tokens": ks[s % len(ks)]}
    )
    p_value = chi2_pvalue(counts, joint)
    print(f"chi-square p-value {p_value:.3g}")
    assert p_value > 1e-3
    assert graphs.target_pass.replays > 0 and graphs.draft_depth.replays > 0
    assert engine.executor.draft_grammars.num_steps > 0


def test_unmasked_draft_positions_are_caught(v16_dirs, monkeypatch):
    """WRONG: only the pending token's row masked, the drafts' positions left free."""
    from speculative.grammar import RequestGrammar

    fill = RequestGrammar.fill
    monkeypatch.setattr(RequestGrammar, "fill", lambda self, rows, d, s: fill(self, rows, [], []))
    p_value, _, _ = sample_constrained(v16_dirs, "oracle", 3, 0)
    assert p_value < 1e-6


def test_constrained_steps_make_no_host_sync(tiny_dir, tiny_drafter_dir):
    """Masks written, applied, drafts sent back, greedy and sampled, chain and tree: no step
    forces a host synchronisation (workers/sync_guard.py) but those of the drafts that follow
    the grammar (workers/draft_grammar.py, `allow_host_sync`)."""
    spec = StructuredSpec(kind="regex", spec="[a-p]{5}[q-z]+")
    for siblings in (0, 2):
        engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=3, draft_siblings=siblings)
        engine.scheduler.intake.grammars = raw_grammars(64, stop=63)
        engine.executor.check_host_sync = True
        params = [
            SamplingParams(max_tokens=12, structured=spec, temperature=t, stop_token_ids=[63])
            for t in (0.0, 1.0)
        ]
        requests = run_to_completion(engine, tiny_prompts(2, seed=8), params)
        for r in requests:  # ended by the grammar, or cut by max_tokens inside it
            text = "".join(chr(ord("a") + t) for t in r.output_ids if t != 63)
            ended = r.output_ids[-1] == 63
            assert re.fullmatch(r"[a-p]{5}[q-z]" + ("+" if ended else "*"), text), text
