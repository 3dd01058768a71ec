"""Every step shape in a CUDA graph: steps with constrained rows, lowered K or mixed K replay
the verify_by_width and draft_depth graphs (workers/cuda_graphs.py) and give plain decoding's
output; sampled steps with per-row K replay the target pass's graph, padded in the verify, with
the eager path's tokens. On CPU the graphs are tests/cpu_graphs.py's stand-in (the real bucketing
and padding); tests/test_gpu.py replays real graphs."""

import contextlib
import json

import pytest
from conftest import replay_graphs_on_cpu, run_to_completion
from test_draft_grammar import PERSON, WEATHER

from speculative.config import SamplingParams, StructuredSpec
from speculative.engine.llm_engine import encode_prompt
from speculative.grammar import tool_call_schema

STEP_PARTS = ("verify", "target_pass", "chain", "verify_by_width", "draft_depth")
QUESTIONS = [
    "Describe a person as JSON.",
    "Say hello.",
    "What is your phone number?",
    "What is the weather in Paris?",
    "Name a colour.",
    "Count to five.",
]
SPECS = [
    StructuredSpec(kind="json", spec=json.dumps(PERSON)),
    None,
    StructuredSpec(kind="regex", spec=r"\(\d{3}\) \d{3}-\d{4}"),
    StructuredSpec(kind="json", spec=json.dumps(tool_call_schema(WEATHER, "required"))),
    None,
    None,
]


def speculative_engine():
    """SmolLM2 with the shipped drafter, K=5."""
    from conftest import _smollm2

    return _smollm2("default", max_batch_size=8, max_model_len=512)


@pytest.fixture(scope="module")
def graphed():
    """With every step graph captured (CPU stand-in)."""
    engine = speculative_engine()
    replay_graphs_on_cpu(engine.executor, *STEP_PARTS)
    return engine


@pytest.fixture(scope="module")
def eager():
    return speculative_engine()


@contextlib.contextmanager
def counting_eager(runner):
    """Counts the eager verifications (those no verify graph replays)."""
    verifier, calls = runner.verifier, []
    real = verifier.eager

    def eager(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    verifier.eager = eager
    try:
        yield calls
    finally:
        verifier.eager = real


def replays(graphs) -> int:
    return sum(g.replays for g in graphs.verify_by_width.values())


def test_mixed_steps_replay_graphs_and_equal_plain(graphed, eager, smollm2_engine):
    """Constrained rows (a JSON schema, a regex, a tool call) beside free ones, with K = 1, 0,
    auto, 2, the engine's and 3, step by step: no greedy step verifies eagerly, the chain's
    depths replay draft_depth, each row is plain (constrained) decoding's, token for token, and
    accepts as many drafts as without graphs (the drafts follow the grammar in the graphs too).
    Then free rows of K 1 and 2 in every slot, the constrained rows' too: their masks are gone.
    Overlapped, the same output; the steps that verify eagerly are those with late constrained
    rows, after the target pass's graph."""
    prompts = [encode_prompt(smollm2_engine.tokenizer, q) for q in QUESTIONS]
    plain_params = [SamplingParams(max_tokens=32, structured=s) for s in SPECS]
    plain = [r.output_ids for r in smollm2_engine.generate(prompts, plain_params)]
    ks = [1, 0, "auto", 2, None, 3]
    params = [p.model_copy(update={"num_draft_tokens": k}) for p, k in zip(plain_params, ks)]
    graphs = graphed.executor.graphs
    graphed.overlap = eager.overlap = False  # no late masks: every verify graphed
    with counting_eager(graphed.executor) as eager_steps:
        mixed = run_to_completion(graphed, prompts, params)
        assert [r.output_ids for r in mixed] == plain
        assert eager_steps == []
        assert replays(graphs) > 0 and graphs.draft_depth.replays > 0
        assert mixed[0].acceptance_length > 1.3  # a constrained K=1 row speculates
        # the constrained rows' slots, now free rows of lowered K
        free = [SamplingParams(max_tokens=16, num_draft_tokens=1 + i % 2) for i in range(8)]
        again = [prompts[i % len(prompts)] for i in range(8)]  # every slot
        before = replays(graphs)
        outputs = run_to_completion(graphed, again, free)
        assert eager_steps == [] and replays(graphs) > before
    reference = smollm2_engine.generate(again, SamplingParams(max_tokens=16))
    assert [r.output_ids for r in outputs] == [r.output_ids for r in reference]
    # the tuner's picks may differ: graphed and eager steps take different times
    fixed = [i for i, k in enumerate(ks) if k != "auto"]
    no_graphs = run_to_completion(eager, [prompts[i] for i in fixed], [params[i] for i in fixed])
    counts = [(r.num_verify_steps, r.num_verify_emitted) for r in no_graphs]
    assert [(mixed[i].num_verify_steps, mixed[i].num_verify_emitted) for i in fixed] == counts
    graphed.overlap = eager.overlap = True
    before = graphs.target_pass.replays
    with counting_eager(graphed.executor) as eager_steps:
        overlapped = run_to_completion(graphed, prompts, params)
    assert [r.output_ids for r in overlapped] == plain
    assert eager_steps and all(p.late_grammar_rows for p in eager_steps)
    assert graphs.target_pass.replays - before == len(eager_steps)


def test_sampled_per_row_k_pads_into_the_target_pass_graph(graphed, eager, smollm2_engine):
    """Seeded sampling with K = 1, 2 and the engine's in one batch: the verify replays the
    target pass's graph at the engine's K (each row's limit stops acceptance at its own), and
    the tokens are those of the engine without graphs (the same uniforms at the same
    positions)."""
    prompts = [encode_prompt(smollm2_engine.tokenizer, q) for q in QUESTIONS[:3]]
    sampled = dict(temperature=0.9, top_p=0.95, max_tokens=24, seed=11)
    params = [SamplingParams(num_draft_tokens=k, **sampled) for k in (1, 2, None)]
    target_pass = graphed.executor.graphs.target_pass
    before = target_pass.replays
    with_graphs = [r.output_ids for r in run_to_completion(graphed, prompts, params)]
    assert target_pass.replays > before
    assert [r.output_ids for r in run_to_completion(eager, prompts, params)] == with_graphs
