"""CUDA graphs of a step function, one per (batch bucket, length bucket), captured at start.

The function takes the batch's slots (padded with the dummy slot up to the bucket) plus more
inputs, each per row [batch] or per token [batch, length bucket], reads and writes only
fixed-address state (KV caches, slot state, the resource manager), and returns per-row outputs.
Replaying copies the real rows into the static inputs (the rest get the input's pad value),
replays, and returns views of the first rows of the static outputs."""

from dataclasses import dataclass

import torch

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
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.lengths = lengths
        self.inputs = inputs
        self.max_tokens = max_tokens  # skip buckets of more than batch x length tokens
        self.graphs: dict[
            tuple[int, int], tuple[list[torch.Tensor], tuple, torch.cuda.CUDAGraph]
        ] = {}

    def capture_all(self) -> None:
        for batch in reversed(
            self.batch_buckets
        ):  # largest first: later graphs reuse its pool memory
            for length in reversed(self.lengths):
                if self.max_tokens is None or batch * length <= self.max_tokens:
                    self._capture(batch, length)

    def _capture(self, batch: int, length: int) -> None:
        inputs = [torch.full((batch,), self.dummy_slot, dtype=torch.long, device=self.device)]
        inputs += [
            torch.full(
                (batch, length) if spec.per_token else (batch,),
                spec.pad,
                dtype=spec.dtype,
                device=self.device,
            )
            for spec in self.inputs
        ]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up lazily initialised kernels outside the capture
            self.fn(*inputs, kv_len=length)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*inputs, kv_len=length)
        self.pool = graph.pool()
        self.graphs[(batch, length)] = (inputs, outputs, graph)

    def _bucket(self, batch: int, length: int) -> tuple[int, int] | None:
        b = next((x for x in self.batch_buckets if x >= batch), None)
        n = next((x for x in self.lengths if x >= length), None)
        return (b, n) if (b, n) in self.graphs else None

    def fits(self, batch: int, length: int) -> bool:
        return self._bucket(batch, length) is not None

    def __call__(self, slots: torch.Tensor, *values: torch.Tensor, kv_len: int) -> tuple:
        B = slots.shape[0]
        static, outputs, graph = self.graphs[self._bucket(B, kv_len)]
        static[0][:B].copy_(slots)
        static[0][B:].fill_(self.dummy_slot)
        for tensor, value, spec in zip(static[1:], values, self.inputs):
            if spec.per_token:
                T = value.shape[1]
                tensor[:B, :T].copy_(value)
                tensor[:B, T:].fill_(spec.pad)
            else:
                tensor[:B].copy_(value)
            tensor[B:].fill_(spec.pad)
        graph.replay()
        return tuple(o[:B] for o in outputs)
