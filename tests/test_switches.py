"""Every EAGLESERVE_* switch that a committed benchmark or GPU job sets, in each combination it
is set in, runs steps here. The engine's switches over SmolLM2 with the shipped drafter and every
step graph (the CPU stand-in, its shared pool included), constrained and free rows of several K
overlapped: each output is plain decoding's. On the H100, shape graphs with
EAGLESERVE_LATE_GRAMMAR=0 lost a constrained step's results (verify_by_width's outputs under the
chain's replay). The switches of GPU-only paths: their decisions, which the GPU reads."""

import pytest
import torch
from conftest import replay_graphs_on_cpu, run_to_completion
from test_graph_shapes import QUESTIONS, SPECS

from speculative.config import SamplingParams
from speculative.engine.chunked_prefill import late_grammar
from speculative.engine.llm_engine import encode_prompt
from workers.cuda_graphs import attention_as_in_graphs
from workers.layers import attention_backend, fp8

KS = [1, None, "auto", 2]  # a constrained, a free, a constrained and a constrained row


@pytest.fixture(scope="module")
def engine():
    from conftest import _smollm2

    return _smollm2("default", max_batch_size=4, max_model_len=512)


@pytest.fixture(scope="module")
def plain(smollm2_engine):
    prompts = [encode_prompt(smollm2_engine.tokenizer, q) for q in QUESTIONS[:4]]
    params = [SamplingParams(max_tokens=12, structured=s) for s in SPECS[:4]]
    return prompts, params, [r.output_ids for r in smollm2_engine.generate(prompts, params)]


@pytest.mark.parametrize("shape_graphs", ["1", "0"])
@pytest.mark.parametrize("late", ["1", "0"])
def test_shape_graphs_and_late_grammar(engine, plain, monkeypatch, shape_graphs, late):
    """benchmarks/shape_graphs.py sets both to 1 and both to 0, auto_k_job.sh SHAPE_GRAPHS=0 and
    the structured benchmark by hand the mixed ones."""
    monkeypatch.setenv("EAGLESERVE_SHAPE_GRAPHS", shape_graphs)
    monkeypatch.setenv("EAGLESERVE_LATE_GRAMMAR", late)
    graphs = replay_graphs_on_cpu(engine.executor)
    assert bool(graphs.verify_by_width) == (shape_graphs == "1")
    engine.scheduler.prefill.late_grammar = late_grammar()
    prompts, params, reference = plain
    mixed_k = [p.model_copy(update={"num_draft_tokens": k}) for p, k in zip(params, KS)]
    requests = run_to_completion(engine, prompts, mixed_k)
    assert [r.output_ids for r in requests] == reference
    # every row the engine's K, the drafts free of the grammar (structured_speed.py's
    # free_drafts): a constrained step replays verify_by_width, then the whole chain's graph
    following, engine.executor.draft_grammars = engine.executor.draft_grammars, None
    try:
        requests = run_to_completion(engine, prompts, params)
    finally:
        engine.executor.draft_grammars = following
    assert [r.output_ids for r in requests] == reference
    assert sum(g.replays for g in graphs.all()) > 0


def test_gpu_only_switches_decide(monkeypatch):
    """EAGLESERVE_PAGED_ATTENTION (kernel_job.sh), PAGED_PREFILL, FP8_GEMM, GQA and
    CUDNN_IN_GRAPHS: what a CUDA device gets with each on and off."""
    cuda, available = torch.device("cuda"), attention_backend.paged_kernel_available
    available.cache_clear()  # read once a process
    assert attention_backend.use_paged_kernel(cuda, 8)
    monkeypatch.setenv("EAGLESERVE_PAGED_ATTENTION", "0")
    available.cache_clear()
    assert not attention_backend.use_paged_kernel(cuda, 8)
    monkeypatch.delenv("EAGLESERVE_PAGED_ATTENTION")
    available.cache_clear()
    long_rows = attention_backend.KERNEL_MAX_QUERY + 1
    assert attention_backend.use_paged_kernel(cuda, long_rows)
    monkeypatch.setenv("EAGLESERVE_PAGED_PREFILL", "0")
    assert not attention_backend.use_paged_kernel(cuda, long_rows)
    assert not attention_backend.use_paged_kernel(torch.device("cpu"), 8)
    for value, enabled in (("1", True), ("0", False)):
        monkeypatch.setenv("EAGLESERVE_CUDNN_IN_GRAPHS", value)
        with attention_as_in_graphs():
            assert torch.backends.cuda.cudnn_sdp_enabled() == enabled
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setenv("EAGLESERVE_CUDNN_IN_GRAPHS", "1")
    with attention_as_in_graphs():  # one-token rows: cuDNN's GQA unless EAGLESERVE_GQA=0
        assert attention_backend.use_gqa(cuda, torch.bfloat16, 8, 1, 32, 128)
        monkeypatch.setenv("EAGLESERVE_GQA", "0")
        assert not attention_backend.use_gqa(cuda, torch.bfloat16, 8, 1, 32, 128)
    monkeypatch.setenv("EAGLESERVE_FP8_GEMM", "0")  # fp8_gpu_job.sh's fallback
    assert not fp8.scaled_mm_available(cuda)
