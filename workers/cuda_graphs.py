"""CUDA graphs of a step function, one per (batch bucket, length bucket), captured at start.

The function takes the batch's slots (padded with the dummy slot up to the bucket) plus more
inputs, each per row [batch] or per token [batch, length bucket], reads and writes only
fixed-address state (KV caches, slot state, the resource manager), and returns per-row outputs.
Replaying copies the real rows into the static inputs (the rest get the input's pad value),
replays, and returns views of the first rows of the static outputs.

Where the paged kernel runs the step's attention, the step graphs have one length, the cache's:
they are keyed by batch bucket only. The block table (KVCache.block_table) and each row's
length (SlotState.num_computed, from which positions come) are static buffers the graph reads
in place, so one capture serves every context length. A per-step value the kernel may come to
need (a split count, say) would be one more GraphInput, copied in at each replay."""

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from workers.layers import attention_backend

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def kv_buckets(cache_len: int, smallest: int = 256) -> list[int]:
    """Doubling sizes from `smallest`, then the cache length itself."""
    sizes, size = [], smallest
    while size < cache_len:
        sizes.append(size)
        size *= 2
    return sizes + [cache_len]


@dataclass(frozen=True)
class GraphInput:
    dtype: torch.dtype
    per_token: bool = False  # [batch, length bucket] rather than [batch]
    pad: int = 0
    width: int = 0  # [batch, width] rather than [batch] (a grammar's bitmask)

    def shape(self, batch: int, length: int) -> tuple[int, ...]:
        if self.per_token:
            return (batch, length)
        return (batch, self.width) if self.width else (batch,)


class StepGraphs:
    def __init__(
        self,
        fn,
        max_batch: int,
        lengths: list[int],
        dummy_slot: int,
        inputs: list[GraphInput],
        device,
        max_tokens: int | None = None,
    ):
        self.fn, self.dummy_slot, self.device = fn, dummy_slot, device
        self.pool = None  # a memory pool shared with graphs captured before (set by the caller)
        # where warm-ups run (set by the caller): one for all, since the allocator keeps what a
        # stream freed for that stream, and a new torch.cuda.Stream() cycles through 32
        self.side_stream = None
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.lengths = lengths
        self.inputs = inputs
        self.max_tokens = max_tokens  # skip buckets of more than batch x length tokens
        self.replays = 0
        self.graphs: dict[
            tuple[int, int], tuple[list[torch.Tensor], tuple, torch.cuda.CUDAGraph]
        ] = {}

    def capture_keys(self) -> list[tuple[int, int]]:
        """The (batch, length) buckets to capture, largest first: later graphs reuse its pool
        memory."""
        keys = [(b, n) for b in reversed(self.batch_buckets) for n in reversed(self.lengths)]
        return [(b, n) for b, n in keys if self.max_tokens is None or b * n <= self.max_tokens]

    def capture_all(self) -> None:
        for batch, length in self.capture_keys():
            self._capture(batch, length)

    def estimate(self, run_measured) -> tuple[int, int]:
        """What capture_all would take, without capturing: (the largest transient bytes of a
        bucket's function, the bytes the graphs keep: static inputs and outputs).
        run_measured(fn, *args, **kwargs) -> (the transient bytes of the call, its outputs).
        The function runs once a length, at its largest batch bucket; the smaller buckets'
        inputs and outputs, all per row, are scaled to their batch."""
        peak, kept, keys = 0, 0, self.capture_keys()
        for length in self.lengths:
            batches = [b for b, n in keys if n == length]
            if not batches:
                continue
            largest = batches[0]
            inputs = self.static_inputs(largest, length)
            transient, outputs = run_measured(self.fn, *inputs, kv_len=length)
            per_row = sum(t.nbytes for t in (*inputs, *outputs)) / largest
            peak = max(peak, transient)
            kept += round(per_row * sum(batches))
        return peak, kept

    def static_inputs(self, batch: int, length: int) -> list[torch.Tensor]:
        """A bucket's inputs, filled with their pad values: the slots, then each GraphInput."""
        inputs = [torch.full((batch,), self.dummy_slot, dtype=torch.long, device=self.device)]
        return inputs + [
            torch.full(spec.shape(batch, length), spec.pad, dtype=spec.dtype, device=self.device)
            for spec in self.inputs
        ]

    def _capture(self, batch: int, length: int) -> None:
        inputs = self.static_inputs(batch, length)
        side = self.side_stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up lazily initialised kernels outside the capture
            self.fn(*inputs, kv_len=length)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*inputs, kv_len=length)
        self.pool = graph.pool()
        self.graphs[(batch, length)] = (inputs, outputs, graph)

    def bucket_length(self, length: int) -> int | None:
        return next((x for x in self.lengths if x >= length), None)

    def _bucket(self, batch: int, length: int) -> tuple[int, int] | None:
        b = next((x for x in self.batch_buckets if x >= batch), None)
        n = self.bucket_length(length)
        return (b, n) if (b, n) in self.graphs else None

    def fits(self, batch: int, length: int) -> bool:
        return self._bucket(batch, length) is not None

    def __call__(self, slots: torch.Tensor, *values: torch.Tensor | None, kv_len: int) -> tuple:
        """Replay for these rows (a value None: every row gets the input's pad)."""
        B = slots.shape[0]
        static, outputs, graph = self.graphs[self._bucket(B, kv_len)]
        static[0][:B].copy_(slots)
        static[0][B:].fill_(self.dummy_slot)
        for tensor, value, spec in zip(static[1:], values, self.inputs):
            if value is None:
                tensor.fill_(spec.pad)
                continue
            if spec.per_token:
                T = value.shape[1]
                tensor[:B, :T].copy_(value)
                tensor[:B, T:].fill_(spec.pad)
            else:
                tensor[:B].copy_(value)
            tensor[B:].fill_(spec.pad)
        graph.replay()
        self.replays += 1
        return tuple(o[:B] for o in outputs)


PREFILL_GRAPH_TOKENS = 2048  # prefills of up to this many (padded) tokens run as CUDA graphs


@dataclass
class StepGraphSet:
    """A runner's graphs (None: not captured; the eager path runs)."""

    prefill: StepGraphs | None = None  # greedy prefill
    verify: StepGraphs | None = None  # the greedy verify pass (or the whole decode step)
    target_pass: StepGraphs | None = None  # the target pass alone, for eager verification
    chain: StepGraphs | None = None  # draft forwards 2..K
    # the greedy verify pass with per-row limits and grammar masks, by its drafts a row
    # (Verifier.greedy_limited): steps with per-row K or constrained rows
    verify_by_width: dict[int, StepGraphs] = field(default_factory=dict)
    draft_depth: StepGraphs | None = None  # one draft forward (per-row K, constrained chains)
    pool_bytes: int = 0  # measured at their capture
    estimated_bytes: int = 0  # estimated before it, where the pool was sized by measuring

    def all(self) -> list[StepGraphs]:
        # capture order = replay order within a step (they share one pool): every verify graph
        # before the chains, whose replays would otherwise overwrite a verify graph's outputs
        graphs = (self.prefill, self.verify, self.target_pass, *self.verify_by_width.values())
        graphs += (self.chain, self.draft_depth)
        return [g for g in graphs if g is not None]

    def limited_verify(self, width: int) -> StepGraphs | None:
        """The verify_by_width graphs of the fewest drafts a row >= width (padded in the verify:
        the rows' limits stop acceptance where their own drafts end), or None."""
        return next((g for w, g in sorted(self.verify_by_width.items()) if w >= width), None)


def verify_widths(K: int, M: int) -> list[int]:
    """The drafts a row of the verify_by_width graphs: none (plain decoding), the powers of two
    below K, and K; a draft tree's only K."""
    if M:
        return [K]
    return sorted({0, K} | {1 << i for i in range(K.bit_length()) if 1 << i < K})


def prefill_graphs(runner, graphs_class=StepGraphs) -> StepGraphs:
    """The greedy prefill's graphs (to capture): per batch and prompt length bucket, up to
    PREFILL_GRAPH_TOKENS tokens. Inputs: lens, starts (past a cached prefix), ids."""
    max_tokens = min(PREFILL_GRAPH_TOKENS, runner.resources.features.shape[0])
    lengths = [n for n in kv_buckets(runner.max_model_len, 16) if n <= max_tokens]
    inputs = [GraphInput(torch.long, pad=1), GraphInput(torch.long)]
    inputs.append(GraphInput(torch.long, per_token=True))
    fn, slots, dummy = runner.prefiller.graphed, runner.num_slots, runner.kv.dummy_slot
    return graphs_class(fn, slots, lengths, dummy, inputs, runner.device, max_tokens)


def step_graph_set(runner, graphs_class=StepGraphs, batch_only: bool | None = None) -> StepGraphSet:
    """The runner's graphs, to capture (graphs_class: tests run them eagerly on CPU).
    batch_only: the step graphs keyed by batch bucket only, at the cache's whole length (default:
    where the paged kernel runs the verify pass)."""
    slots, dummy, dev = runner.num_slots, runner.kv.dummy_slot, runner.device
    # the gather reads kv_len keys a row, so graphs bucket by it too; the paged kernel reads
    # each row's own keys, so one length serves every step: buckets by batch size only (and the
    # gather at the whole length gives the same tokens, only slower: the CPU stand-in's keying)
    if batch_only is None:
        batch_only = attention_backend.use_paged_kernel(dev, runner.T)
    cache_len = runner.kv.cache_len
    lengths = [cache_len] if batch_only else kv_buckets(cache_len)
    verifier = runner.verifier
    verify = verifier.decode_step if verifier.whole_step else verifier.greedy
    graphs = StepGraphSet(
        prefill=prefill_graphs(runner, graphs_class),
        verify=graphs_class(verify, slots, lengths, dummy, [], dev),
        target_pass=graphs_class(verifier.target_pass, slots, lengths, dummy, [], dev),
    )
    # EAGLESERVE_SHAPE_GRAPHS=0: those steps verify and draft eagerly, for A/B
    shapes = os.environ.get("EAGLESERVE_SHAPE_GRAPHS", "1") != "0"
    K, mask_width = max(runner.K, 0), runner.state.allocate_grammar_mask().shape[-1]
    for width in verify_widths(K, runner.M) if shapes else []:
        fn = functools.partial(verifier.greedy_limited, width=width)
        limits = [GraphInput(torch.long, pad=K)]
        graphs.verify_by_width[width] = graphs_class(fn, slots, lengths, dummy, limits, dev)
    if runner.drafter is not None and runner.K > 1:
        chain_inputs = [GraphInput(torch.long), GraphInput(torch.long)]
        draft_steps = runner.proposer.draft_steps
        graphs.chain = graphs_class(draft_steps, slots, lengths, dummy, chain_inputs, dev)
    if runner.drafter is not None and runner.K > 1 and shapes:
        depth_inputs = [GraphInput(torch.long)] * 3  # last draft, its position, the depth
        depth_inputs += [GraphInput(torch.int32, pad=-1, width=mask_width)]  # all allowed
        depth_inputs += [GraphInput(torch.long, pad=-1)]  # none forced
        fn = runner.proposer.draft_forward
        graphs.draft_depth = graphs_class(fn, slots, lengths, dummy, depth_inputs, dev)
    return graphs


def capture_step_graphs(runner, estimated_bytes: int = 0) -> StepGraphSet:
    """CUDA graphs for greedy prefill of up to PREFILL_GRAPH_TOKENS tokens (longer prefills
    amortise their launches), the greedy verify pass (plain decode when K=0), the target pass
    alone (the other steps' verify) and draft steps 2..K. They share one memory pool, which is
    safe only when they replay in the order they were captured: a step runs prefill, then verify
    or the target pass (whose output the eager verification reads before anything else
    replays), then the draft chain."""
    start = time.perf_counter()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    graphs = step_graph_set(runner)
    _capture_in_one_pool(graphs.all())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what the warm-ups left cached: the graphs keep only their pool
    graphs.pool_bytes = free_before - torch.cuda.mem_get_info()[0]
    graphs.estimated_bytes = estimated_bytes
    estimate = f", estimated {estimated_bytes / 2**20:.1f} MiB" if estimated_bytes else ""
    log.info(
        "rank %d: captured %d CUDA graphs in %.1f s (%.1f MiB%s)",
        runner.rank,
        sum(len(g.graphs) for g in graphs.all()),
        time.perf_counter() - start,
        graphs.pool_bytes / 2**20,
        estimate,
    )
    return graphs


@contextlib.contextmanager
def attention_as_in_graphs():
    # Captured with cuDNN attention, which made plain decoding 1.26x and EAGLE-3 1.31x faster at
    # batch 8 on the H200 and runs GQA attention without copies (workers/layers/attention.py); eager
    # forwards keep it off (a host-side plan per new shape). EAGLESERVE_CUDNN_IN_GRAPHS=0
    # captures without it.
    use_cudnn = os.environ.get("EAGLESERVE_CUDNN_IN_GRAPHS", "1") != "0"
    torch.backends.cuda.enable_cudnn_sdp(use_cudnn)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)


def _capture_in_one_pool(graphs: list[StepGraphs]) -> None:
    pool, side_stream = None, torch.cuda.Stream()
    with attention_as_in_graphs():
        for g in graphs:
            g.pool, g.side_stream = pool, side_stream
            g.capture_all()
            pool = g.pool
