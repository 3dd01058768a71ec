"""CUDA graphs' stand-in on CPU: StepGraphs whose capture keeps an eager replay, so tests run a
runner's graphed functions with the real bucketing and padding (tests/test_gpu.py replays real
graphs).

It also keeps the one hazard of the real graphs' shared memory pool (workers/cuda_graphs.py):
a graph captured after another may hold its outputs in memory the earlier graph's intermediates
use, so replaying the earlier graph overwrites them. The stand-in overwrites them with garbage
(SharedPool), so a step that reads a graph's outputs after replaying one captured before it
fails here as it does on the GPU."""

import torch

from workers.cuda_graphs import StepGraphs


def poison(t: torch.Tensor) -> None:
    """What a later replay leaves in memory it shares: garbage of the tensor's type."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class SharedPool:
    """The outputs of every graph captured into one pool, in capture order."""

    def __init__(self):
        self.outputs: list[list[torch.Tensor]] = []

    def add(self, outputs: list) -> int:
        self.outputs.append(outputs)
        return len(self.outputs) - 1

    def replayed(self, index: int) -> None:
        for outputs in self.outputs[index + 1 :]:
            for t in outputs:
                poison(t)


class EagerReplay:
    """Replaying runs the function on the static inputs and copies its results into the static
    outputs, made at the first replay (so capturing runs nothing: a graph never replayed has no
    outputs to read); then, as the real pool would, clobbers the outputs of later captures."""

    def __init__(self, fn, inputs, length: int, pool: SharedPool):
        self.fn, self.inputs, self.outputs, self.length = fn, inputs, [], length
        self.pool, self.index = pool, pool.add(self.outputs)

    def replay(self) -> None:
        results = self.fn(*self.inputs, kv_len=self.length)
        if not self.outputs:  # cloned: an output may be a view (expanded) that copy_ cannot fill
            self.outputs.extend(r.clone() for r in results)
        else:
            for static, new in zip(self.outputs, results):
                static.copy_(new)
        self.pool.replayed(self.index)


class CpuStepGraphs(StepGraphs):
    """Also counts its captures and records the kv_len each replay stood for. `pool`: the
    SharedPool of the graphs captured with it (set before capture_all; a new one if unset)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captures = 0
        self.replayed_kv_lens: list[int] = []

    def _capture(self, batch: int, length: int) -> None:
        if self.pool is None:
            self.pool = SharedPool()
        inputs = self.static_inputs(batch, length)
        replay = EagerReplay(self.fn, inputs, length, self.pool)
        self.graphs[(batch, length)] = (inputs, replay.outputs, replay)
        self.captures += 1

    def __call__(self, slots, *values, kv_len: int) -> tuple:
        self.replayed_kv_lens.append(kv_len)
        return super().__call__(slots, *values, kv_len=kv_len)
