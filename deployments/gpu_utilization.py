"""The GPU utilization NVML reports while a benchmark level runs (`eagleserve bench`)."""

import threading


class GpuUtilization:
    """NVML's GPU utilization (the share of time at least one kernel ran: nvidia-smi's GPU-Util),
    polled in a thread while a level runs; the mean of the busiest GPU of this host. Unlike CUDA
    events around each step, it counts the gaps inside a step as idle, so it stays valid with
    overlap. None when off or without NVML (no GPU, no nvidia-ml-py)."""

    def __init__(self, enabled: bool = True, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.samples: list[list[int]] = []  # per poll, per GPU: percent
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None
        if not enabled:
            return
        try:
            try:
                import pynvml
            except ImportError:
                from ray._private.thirdparty import pynvml  # Ray's own copy
            pynvml.nvmlInit()
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            self._nvml = pynvml
        except Exception:  # no pynvml, no driver, no GPU
            pass

    def _poll(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self.samples.append(
                    [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
                )
        except Exception:  # e.g. a GPU that reports no utilization: keep what was read
            pass

    def __enter__(self) -> "GpuUtilization":
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._nvml.nvmlShutdown()

    @property
    def busy_fraction(self) -> float | None:
        if not self.samples:
            return None
        return max(sum(gpu) / len(gpu) for gpu in zip(*self.samples)) / 100
