"""The memory the step's CUDA graphs will take (workers/cuda_graphs.py), estimated before the KV
pool is sized (workers/memory_profile.py), without capturing them."""

import torch

from workers.cuda_graphs import attention_as_in_graphs, step_graph_set

# allowances for what the estimate cannot see: per graph, the driver's instantiated graph and the
# pool's rounding of small outputs to 2 MiB segments; over the measured part, the pool's
# fragmentation across buckets. On an H100 the capture measured up to 1.34x an estimate with 1 MiB
# a graph and no margin (SmolLM2, 75 graphs at 256 slots: 598 MiB against 446); tests/test_gpu.py
# compares the two
GRAPH_OVERHEAD_BYTES = 2 << 20
GRAPH_MARGIN = 1.25


def estimate_graph_bytes(runner) -> int:
    """The memory capture_step_graphs will take, estimated without capturing (so sizing the
    pool costs no capture of its own): each kind's heaviest transient memory, measured by
    running its function once eagerly with attention as in the graphs, plus what every graph
    keeps (static inputs, outputs), times GRAPH_MARGIN, and GRAPH_OVERHEAD_BYTES a graph. The
    kinds' peaks are summed: they share one pool, but a kind's allocations need not fit the
    blocks an earlier kind freed."""
    graphs = step_graph_set(runner).all()
    with attention_as_in_graphs():
        estimates = [g.estimate(_cuda_transient) for g in graphs]
    count = sum(len(g.capture_keys()) for g in graphs)
    measured = sum(p + k for p, k in estimates)
    return int(measured * GRAPH_MARGIN) + count * GRAPH_OVERHEAD_BYTES


def _cuda_transient(fn, *args, **kwargs) -> tuple[int, tuple]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outputs = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, outputs
