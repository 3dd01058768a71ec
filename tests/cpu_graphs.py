"""CUDA graphs' stand-in on CPU: StepGraphs whose capture keeps an eager replay, so tests run a
runner's graphed functions with the real bucketing and padding (tests/test_gpu.py replays real
graphs)."""

from workers.cuda_graphs import StepGraphs


class EagerReplay:
    """Replaying runs the function again on the static inputs and copies its results into the
    static outputs."""

    def __init__(self, fn, inputs, outputs, length: int):
        self.fn, self.inputs, self.outputs, self.length = fn, inputs, outputs, length

    def replay(self) -> None:
        for static, new in zip(self.outputs, self.fn(*self.inputs, kv_len=self.length)):
            static.copy_(new)


class CpuStepGraphs(StepGraphs):
    """Also counts its captures and records the kv_len each replay stood for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captures = 0
        self.replayed_kv_lens: list[int] = []

    def _capture(self, batch: int, length: int) -> None:
        inputs = self.static_inputs(batch, length)
        # cloned: an output may be a view (expanded) that copy_ cannot write into
        outputs = tuple(o.clone() for o in self.fn(*inputs, kv_len=length))
        replay = EagerReplay(self.fn, inputs, outputs, length)
        self.graphs[(batch, length)] = (inputs, outputs, replay)
        self.captures += 1

    def __call__(self, slots, *values, kv_len: int) -> tuple:
        self.replayed_kv_lens.append(kv_len)
        return super().__call__(slots, *values, kv_len=kv_len)
