"""CUDA graphs of a step function, one per (batch bucket, KV-length bucket), captured at start.

The function takes the batch's slots (padded with the dummy slot up to the bucket) plus more
per-row tensors, reads and writes only fixed-address state (KV caches, slot state, the resource
manager), and returns per-row outputs. Replaying copies the real rows into the static inputs,
replays, and returns views of the first rows of the static outputs."""
import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def kv_buckets(cache_len: int) -> list[int]:
    sizes, size = [], 256
    while size < cache_len:
        sizes.append(size)
        size *= 2
    return sizes + [cache_len]


class StepGraphs:
    def __init__(self, fn, max_batch: int, cache_len: int, dummy_slot: int, extra_dtypes: list[torch.dtype],
                 device, pool=None):
        self.fn, self.dummy_slot, self.device, self.pool = fn, dummy_slot, device, pool
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.kv_buckets = kv_buckets(cache_len)
        self.extra_dtypes = extra_dtypes
        self.graphs: dict[tuple[int, int], tuple[list[torch.Tensor], tuple, torch.cuda.CUDAGraph]] = {}

    def capture_all(self) -> None:
        for batch in reversed(self.batch_buckets):  # largest first: later graphs reuse its pool memory
            for kv_len in self.kv_buckets:
                self._capture(batch, kv_len)

    def _capture(self, batch: int, kv_len: int) -> None:
        inputs = [torch.full((batch,), self.dummy_slot, dtype=torch.long, device=self.device)]
        inputs += [torch.zeros(batch, dtype=dtype, device=self.device) for dtype in self.extra_dtypes]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up lazily initialised kernels outside the capture
            self.fn(*inputs, kv_len=kv_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*inputs, kv_len=kv_len)
        self.pool = graph.pool()
        self.graphs[(batch, kv_len)] = (inputs, outputs, graph)

    def fits(self, batch: int, kv_len: int) -> bool:
        return batch <= self.batch_buckets[-1] and kv_len <= self.kv_buckets[-1]

    def __call__(self, slots: torch.Tensor, *extras: torch.Tensor, kv_len: int) -> tuple:
        B = slots.shape[0]
        batch = next(b for b in self.batch_buckets if b >= B)
        kv = next(k for k in self.kv_buckets if k >= kv_len)
        inputs, outputs, graph = self.graphs[(batch, kv)]
        inputs[0][:B].copy_(slots)
        inputs[0][B:].fill_(self.dummy_slot)
        for static, value in zip(inputs[1:], extras):
            static[:B].copy_(value)
        graph.replay()
        return tuple(o[:B] for o in outputs)
