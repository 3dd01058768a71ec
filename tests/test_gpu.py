"""GPU checks (skipped without CUDA): CUDA-graph output equals eager output, speculative equals
plain, and no host synchronisation inside a step under torch.cuda.set_sync_debug_mode("error").
On the H200 machine: `python tests/test_gpu.py` (no pytest there)
or `python -m pytest tests/test_gpu.py`."""

import json
import os
import time

import pytest
import torch

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.llm_engine import LLMEngine, encode_prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
MODEL = os.environ.get("EAGLESERVE_GPU_MODEL", "smollm2-135m")
DRAFTER = os.environ.get("EAGLESERVE_GPU_DRAFTER", "default")
POOL_GB = 1.0  # the checks' engines skip sizing by measurement, which one test checks
QUESTIONS = [
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Name three colors.",
    "Explain gravity briefly.",
    "What is the capital of Japan?",
]


def _run(
    drafter: str,
    graphs: bool,
    k: int = 3,
    check_sync: bool = False,
    max_tokens: int = 48,
    max_batch_size: int = 8,
    graph_first_draft: bool = False,
    prompt_lookup: float = 0.0,
    questions: list[str] = QUESTIONS,
    siblings: int = 0,
):
    """-> (output ids per question, the engine's number of accepted drafts)."""
    cfg = EngineConfig(
        model=MODEL,
        drafter=drafter,
        num_draft_tokens=k,
        max_batch_size=max_batch_size,
        max_model_len=512,
        device="cuda",
        dtype="float32",
        kv_cache_memory_gb=POOL_GB,
        cuda_graphs=graphs,
        graph_first_draft=graph_first_draft,
        prompt_lookup=prompt_lookup,
        draft_siblings=siblings,
    )
    engine = LLMEngine(cfg)
    engine.executor.check_host_sync = check_sync
    prompts = [encode_prompt(engine.tokenizer, q) for q in questions]
    outputs = [
        r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    ]
    return outputs, engine.scheduler.stats.num_draft_accepted


def _generate(*args, **kwargs) -> list[list[int]]:
    return _run(*args, **kwargs)[0]


def test_graphs_equal_eager_and_spec_equals_plain():
    plain_eager = _generate("none", graphs=False)
    assert _generate("none", graphs=True) == plain_eager
    assert _generate(DRAFTER, graphs=False) == plain_eager
    assert _generate(DRAFTER, graphs=True) == plain_eager
    assert _generate(DRAFTER, graphs=True, k=5) == plain_eager
    # two slots for five prompts: prefills join running decodes in mixed steps (graphed prefill,
    # verify and draft chain replayed in one step)
    assert _generate(DRAFTER, graphs=True, max_batch_size=2) == plain_eager
    assert _generate("none", graphs=True, max_batch_size=2) == plain_eager
    # the whole decode step (verify, first draft, draft steps 2..K) as one graph
    assert _generate(DRAFTER, graphs=True, graph_first_draft=True) == plain_eager
    assert (
        _generate(DRAFTER, graphs=True, k=5, max_batch_size=2, graph_first_draft=True)
        == plain_eager
    )
    # prompt lookup in the chain: its token history written and read inside the graphs
    assert _generate(DRAFTER, graphs=True, prompt_lookup=0.5) == plain_eager
    assert (
        _generate(
            DRAFTER, graphs=True, k=5, max_batch_size=2, graph_first_draft=True, prompt_lookup=0.5
        )
        == plain_eager
    )
    # the draft tree: its mask, the siblings' state and the moved sibling K/V inside the graphs
    assert _generate(DRAFTER, graphs=True, siblings=1) == plain_eager
    assert (
        _generate(
            DRAFTER,
            graphs=True,
            k=5,
            max_batch_size=2,
            graph_first_draft=True,
            siblings=2,
            prompt_lookup=0.5,
        )
        == plain_eager
    )


def test_logprobs_take_the_eager_path_unchanged():
    """A request with logprobs (of its output and its prompt), penalties or a logit_bias makes its
    steps run eager (the graphs return no logits), without host synchronisation: the other requests'
    tokens stay those of the graphs, and each token is its own top token with the
    same log-probability."""
    plain = _generate(DRAFTER, graphs=True)
    engine = LLMEngine(
        EngineConfig(
            model=MODEL,
            drafter=DRAFTER,
            num_draft_tokens=3,
            max_batch_size=8,
            max_model_len=512,
            device="cuda",
            dtype="float32",
            kv_cache_memory_gb=POOL_GB,
        )
    )
    engine.executor.check_host_sync = True
    prompts = [encode_prompt(engine.tokenizer, q) for q in QUESTIONS]
    requests = [
        engine.add_request(
            p,
            SamplingParams(
                max_tokens=48, logprobs=2 if i % 2 else None, prompt_logprobs=2 if i % 2 else None
            ),
        )
        for i, p in enumerate(prompts)
    ]
    engine.add_request(
        prompts[0],
        SamplingParams(
            max_tokens=48,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            logit_bias={13: 2.0, 28: -5.0},
        ),
    )
    logprobs = {r.request_id: [] for r in requests}
    while engine.has_work:
        for out in engine.step():
            logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
    assert [r.output_ids for r in requests] == plain
    for i, r in enumerate(requests):
        got = logprobs[r.request_id]
        assert (len(got) == len(r.output_ids)) if i % 2 else not got
        assert all(top[0] == (t, lp) for t, (lp, top) in zip(r.output_ids, got))


def test_sampled_steps_replay_the_target_pass_graph():
    """Sampled steps (eager verification) replay the target pass's graph: seeded requests give the
    tokens they give with graphs off, plain and speculative, chain and tree, and
    the pass graphs exist."""
    for drafter, siblings in (("none", 0), (DRAFTER, 0), (DRAFTER, 1)):
        outputs = []
        for graphs in (False, True):
            engine = LLMEngine(
                EngineConfig(
                    model=MODEL,
                    drafter=drafter,
                    num_draft_tokens=3,
                    max_batch_size=8,
                    max_model_len=512,
                    device="cuda",
                    dtype="float32",
                    kv_cache_memory_gb=POOL_GB,
                    cuda_graphs=graphs,
                    draft_siblings=siblings,
                )
            )
            engine.executor.check_host_sync = True
            assert (engine.executor.graphs.target_pass is not None) == graphs
            prompts = [encode_prompt(engine.tokenizer, q) for q in QUESTIONS]
            params = [
                SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=i)
                for i in range(len(prompts))
            ]
            outputs.append([r.output_ids for r in engine.generate(prompts, params)])
        assert outputs[0] == outputs[1], (drafter, siblings)


def test_mixed_k_and_constrained_steps_replay_graphs():
    """Rows of K 0, 1, 2, auto and the engine's, constrained (a JSON schema, a regex) beside free
    ones, step by step: greedy steps replay the verify_by_width graphs and the chains the
    draft_depth graph, with the eager engine's output and, K fixed, its accepted drafts (the
    grammar's masks reach the graphed drafts); overlapped (late masks), the same output."""
    from speculative.config import StructuredSpec

    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    specs = [StructuredSpec(kind="json", spec=json.dumps(person)), None,
             StructuredSpec(kind="regex", spec=r"\(\d{3}\) \d{3}-\d{4}"), None, None]  # fmt: skip
    ks = [1, 0, 2, "auto", None]
    params = [SamplingParams(max_tokens=40, structured=s, num_draft_tokens=k)
              for s, k in zip(specs, ks)]  # fmt: skip
    results = []
    for graphs in (False, True):
        cfg = EngineConfig(model=MODEL, drafter=DRAFTER, num_draft_tokens=3, max_batch_size=8,
                           max_model_len=512, device="cuda", dtype="float32",
                           kv_cache_memory_gb=POOL_GB, cuda_graphs=graphs)  # fmt: skip
        engine = LLMEngine(cfg)
        engine.overlap = False  # no late masks: every verify graphed
        prompts = [encode_prompt(engine.tokenizer, q) for q in QUESTIONS]
        requests = engine.generate(prompts, params)
        fixed = [(r.num_verify_steps, r.num_verify_emitted) for r, k in zip(requests, ks)
                 if k != "auto"]  # fmt: skip
        results.append(([r.output_ids for r in requests], fixed))
        if graphs:
            by_width = engine.executor.graphs.verify_by_width.values()
            assert sum(g.replays for g in by_width) > 0
            assert engine.executor.graphs.draft_depth.replays > 0
    assert results[0] == results[1]
    engine.overlap = True  # late masks: the target pass graphed, then the verification eager
    assert [r.output_ids for r in engine.generate(prompts, params)] == results[0][0]


def test_auto_k_through_every_k_equals_eager():
    """num_draft_tokens auto with the tuner forced from K=5 down to 0 and back, alone in the batch
    (verify_by_width, then the whole chain's graph, which once overwrote its results in the
    shared pool: tests/test_auto_k.py is the CPU form): graphed output equals eager and plain."""
    import itertools

    plain = _generate("none", graphs=False, max_batch_size=1, questions=QUESTIONS[:2])
    cycle = [5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 5, 5, 0, 5, 3, 0, 2]
    for graphs in (False, True):
        cfg = EngineConfig(model=MODEL, drafter=DRAFTER, num_draft_tokens="auto",
                           max_batch_size=1, max_model_len=512, device="cuda", dtype="float32",
                           kv_cache_memory_gb=POOL_GB, cuda_graphs=graphs)  # fmt: skip
        engine = LLMEngine(cfg)
        tuner, picks = engine.scheduler.tuner, itertools.cycle(cycle)
        tuner.choose = lambda *args, _picks=picks, **kwargs: next(_picks)
        prompts = [encode_prompt(engine.tokenizer, q) for q in QUESTIONS[:2]]
        params = SamplingParams(max_tokens=48)
        assert [r.output_ids for r in engine.generate(prompts, params)] == plain, graphs


def test_prompt_lookup_drafts_the_same_in_graphs():
    """Greedy output cannot show the drafts; the number of accepted drafts can. With prompt lookup
    on, its token history is written and read inside the graphs: graphs and
    eager must draft alike."""
    questions = QUESTIONS + [
        "Repeat exactly: red fox, blue fox, red fox, blue fox, red fox, blue fox."
    ]
    eager = _run(DRAFTER, graphs=False, max_batch_size=2, prompt_lookup=0.8, questions=questions)
    assert (
        _run(DRAFTER, graphs=True, max_batch_size=2, prompt_lookup=0.8, questions=questions)
        == eager
    )


def test_draft_tree_drafts_the_same_in_graphs():
    """The same for the draft tree: siblings proposed, verified and taken alike in graphs and eager,
    and they are taken (more drafts accepted than by the chain)."""
    chain = _run(DRAFTER, graphs=True, max_batch_size=2)
    eager = _run(DRAFTER, graphs=False, max_batch_size=2, siblings=2)
    assert _run(DRAFTER, graphs=True, max_batch_size=2, siblings=2) == eager
    assert eager[0] == chain[0] and eager[1] > chain[1]


def test_prefills_after_a_cached_prefix_replay_the_graph():
    """One request at a time: every prompt after the first starts past the chat template's cached
    blocks, and still prefills in the graph, with the eager path's tokens."""

    def one_by_one(graphs: bool):
        cfg = EngineConfig(model=MODEL, drafter=DRAFTER, num_draft_tokens=3, max_model_len=512,
                           device="cuda", dtype="float32", cuda_graphs=graphs,
                           kv_cache_memory_gb=POOL_GB)  # fmt: skip
        engine = LLMEngine(cfg)
        outputs = []
        for q in QUESTIONS:
            prompt = encode_prompt(engine.tokenizer, q)
            outputs += [r.output_ids for r in engine.generate([prompt], SamplingParams())]
        assert engine.scheduler.metrics()["prefix_cache_hits_total"] > 0
        return outputs, engine.executor.graphs.prefill

    graphed, prefill_graphs = one_by_one(graphs=True)
    assert prefill_graphs.replays == len(QUESTIONS)
    assert graphed == one_by_one(graphs=False)[0]


def test_pool_sized_by_gpu_memory_utilization_stays_within_it():
    """Without kv_cache_memory_gb the pool takes what gpu_memory_utilization leaves after the
    weights, the profiled peak step and the graphs: most of it for this small model, and the
    engine never holds more than the budget, running steps included (vLLM's meaning: memory this
    engine adds to what the GPU held when it started). The tokens are the same."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free_at_start, total = torch.cuda.mem_get_info()
    reserved_at_start = torch.cuda.memory_reserved()
    cfg = EngineConfig(model=MODEL, drafter=DRAFTER, num_draft_tokens=3, max_model_len=2048,
                       device="cuda", dtype="float32", gpu_memory_utilization=0.5)  # fmt: skip
    engine = LLMEngine(cfg)
    prompts = [encode_prompt(engine.tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=48)
    outputs = [r.output_ids for r in engine.generate(prompts, params)]
    held = free_at_start - torch.cuda.mem_get_info()[0]
    # at the peak: torch's peak reserve (reset by the profiling, after the weights), plus what
    # the engine holds outside torch's allocator (cuBLAS and cuDNN handles)
    outside_torch = held - (torch.cuda.memory_reserved() - reserved_at_start)
    peak = torch.cuda.max_memory_reserved() - reserved_at_start + outside_torch
    pool = engine.executor.kv.nbytes
    budget = 0.5 * total
    print(f"pool {pool / 2**30:.2f} GiB, engine {held / 2**30:.2f} GiB, its peak "
          f"{peak / 2**30:.2f} GiB, budget {budget / 2**30:.2f} GiB")  # fmt: skip
    assert 0.3 * total < pool < held <= peak <= budget, (pool, held, peak, budget)
    del engine
    assert outputs == _generate(DRAFTER, graphs=True)


def test_one_capture_per_batch_bucket_serves_two_context_lengths():
    """With the paged kernel the step graphs are keyed by batch bucket only: as many verify,
    target-pass and draft-chain graphs as batch buckets, each captured once, sizing by
    gpu_memory_utilization included (it estimates the graphs' memory without capturing them).
    Graphed output equals eager at a short context and at one past 2048 tokens."""
    import gc

    from workers.cuda_graphs import StepGraphs

    captures = []
    capture = StepGraphs._capture

    def counted(self, batch: int, length: int) -> None:
        captures.append((batch, length))
        capture(self, batch, length)

    long_question = " ".join(QUESTIONS * 80)  # about 2800 tokens
    outputs, replays = [], []
    StepGraphs._capture = counted
    try:
        for graphs in (True, False):
            # the graphed engine sizes its pool by measuring; the eager one needs no sizing
            sizing = {"gpu_memory_utilization": 0.5} if graphs else {"kv_cache_memory_gb": POOL_GB}
            cfg = EngineConfig(model=MODEL, drafter=DRAFTER, num_draft_tokens=3,
                               max_model_len=4096, max_batch_size=8, device="cuda",
                               dtype="float32", cuda_graphs=graphs, **sizing)  # fmt: skip
            engine = LLMEngine(cfg)
            runner = engine.executor
            params = SamplingParams(max_tokens=32)
            for questions in (QUESTIONS, [long_question]):
                prompts = [encode_prompt(engine.tokenizer, q) for q in questions]
                outputs.append([r.output_ids for r in engine.generate(prompts, params)])
                if graphs:
                    replays.append(runner.graphs.verify.replays)
            if graphs:
                step_graphs = [runner.graphs.verify, runner.graphs.target_pass, runner.graphs.chain]
                for g in step_graphs:
                    assert g.lengths == [runner.kv.cache_len]
                    assert len(g.graphs) == len(g.batch_buckets) == 4
                assert len(captures) == sum(len(g.graphs) for g in runner.graphs.all())
                measured = (runner.graphs.pool_bytes, runner.graphs.estimated_bytes)
                print(f"graphs: {len(captures)} captured, {measured[0] / 2**20:.1f} MiB, "
                      f"estimated {measured[1] / 2**20:.1f} MiB")  # fmt: skip
                del step_graphs, g
            del engine, runner
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        StepGraphs._capture = capture
    assert len(prompts[0]) > 2048
    assert 0 < replays[0] < replays[1]  # the long context replayed the same graphs
    assert outputs[:2] == outputs[2:]
    assert measured[0] <= measured[1], f"the graphs took more than estimated: {measured}"


def test_no_host_sync_inside_steps():
    plain = _generate("none", graphs=True, max_tokens=16)
    assert _generate(DRAFTER, graphs=True, check_sync=True, max_tokens=16) == plain
    assert _generate(DRAFTER, graphs=False, check_sync=True, max_tokens=16) == plain
    assert (
        _generate(DRAFTER, graphs=True, check_sync=True, max_tokens=16, graph_first_draft=True)
        == plain
    )
    assert (
        _generate(DRAFTER, graphs=False, check_sync=True, max_tokens=16, prompt_lookup=0.5) == plain
    )
    assert (
        _generate(DRAFTER, graphs=True, check_sync=True, max_tokens=16, prompt_lookup=0.5) == plain
    )
    assert _generate(DRAFTER, graphs=True, check_sync=True, max_tokens=16, siblings=1) == plain


def test_gqa_attention_equals_folded_under_cudnn():
    """In bf16 the graphs run the gather path's GQA attention through cuDNN (the fp32 checks
    above fold): it must give what the folded form gives, and cuDNN must accept it (forced, so no
    silent fallback to math). The paged kernel, which runs rows of up to KERNEL_MAX_QUERY
    tokens, must give it too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import workers.layers.attention_backend
    from workers.layers.attention import CachedAttention, attention_inputs
    from workers.layers.attention_backend import use_gqa
    from workers.layers.kv_cache import ForwardBatch
    from workers.layers.rotary import Rotary

    torch.manual_seed(0)
    dev, dt, H, KV, D = torch.device("cuda"), torch.bfloat16, 9, 3, 64
    attn = CachedAttention(576, 576, H, KV, D, Rotary(D, 1024, 10000.0)).to(dev, dt)
    for weight in attn.parameters():  # created empty: whatever the memory held, NaN included
        weight.normal_(std=0.05)
    was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    kernel_policy = workers.layers.attention_backend.use_paged_kernel
    try:
        for B, T in ((8, 4), (4, 1), (2, 64)):
            assert use_gqa(dev, dt, B, T, H, D) and kernel_policy(dev, T)
            # a paged pool: slot b owns blocks 32b..32b+31 (512 rows), the last block a dummy
            attn.cache = torch.randn(2, 32 * B + 1, 16, KV, D, device=dev, dtype=dt)
            table = torch.arange(32 * B, device=dev).view(B, 32)
            positions = torch.randint(100, 400, (B, 1), device=dev) + torch.arange(T, device=dev)
            slots = torch.arange(B, device=dev)
            blocks = table.gather(1, positions // 16)
            batch = ForwardBatch(slots, positions, positions, blocks, positions % 16, table, 512)
            x = torch.randn(B, T, 576, device=dev, dtype=dt)
            kernel = attn(x, batch, attention_inputs(batch, attn, dt))
            workers.layers.attention_backend.use_paged_kernel = lambda device, query_len: False
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                gqa = attn(x, batch, attention_inputs(batch, attn, dt, gqa=True))
            folded = attn(x, batch, attention_inputs(batch, attn, dt, gqa=False))
            workers.layers.attention_backend.use_paged_kernel = kernel_policy
            torch.testing.assert_close(gqa, folded, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(kernel, folded, rtol=2e-2, atol=2e-2)
    finally:
        workers.layers.attention_backend.use_paged_kernel = kernel_policy
        torch.backends.cuda.enable_cudnn_sdp(was_enabled)


if __name__ == "__main__":
    results = {}
    only = os.environ.get("EAGLESERVE_GPU_TESTS", "test_").split(",")  # name parts to run
    tests = [f for name, f in list(globals().items()) if any(part in name for part in only)]
    tests = [f for f in tests if f.__name__.startswith("test_")]
    for test in tests:  # in the order they are defined; each result written as it comes
        start = time.perf_counter()
        try:
            test()
            results[test.__name__] = "passed"
        except Exception as e:  # report every check, then fail
            results[test.__name__] = f"FAILED: {type(e).__name__}: {e}"
        print(f"{test.__name__}: {results[test.__name__]} ({time.perf_counter() - start:.0f} s)")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "gpu_checks.json"), "w") as f:
                json.dump(results, f, indent=1)
    raise SystemExit(0 if all(v == "passed" for v in results.values()) else 1)
