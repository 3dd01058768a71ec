"""Where one step's time goes, kernel by kernel: torch.profiler around `repeats` calls of a step
(a CUDA graph's replay or an eager step), each kernel's calls and microseconds a step, grouped by
kind, and the gaps: the step's wall time that no kernel fills (launches, host work, syncs).
benchmarks/step_floor.py --profile prints it for each point; alone it needs a step to run."""

import re
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS = [  # (kind, pattern of the kernel's name), first match wins
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|_fp8_weight_only|sum_splits|scaled_mm|linear"),
    ("attention", r"paged_attention|paged_prefill|flash|fmha|attention|combine"),
    ("norm", r"rms_?norm|layer_?norm"),
    ("rotary and elementwise", r"elementwise|vectorized|roll|addcmul|unrolled|silu|mul|add"),
    ("copy and index", r"copy|index|gather|scatter|cat|fill"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def profiled_run(fn, device: torch.device, repeats: int):
    """torch.profiler (CPU, and CUDA where it runs) around `repeats` calls of fn, synchronized
    at both ends. -> (the profile, wall seconds of the calls)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    return prof, wall_s


def profile_step(fn, device: torch.device, repeats: int = 10) -> dict:
    """fn() runs one step (warmed by the caller). -> {"wall_us", "kernel_us", "gap_us", kernels,
    kinds}: per step, averaged over `repeats`."""
    cuda = device.type == "cuda"
    prof, wall_s = profiled_run(fn, device, repeats)
    wall_us = wall_s * 1e6 / repeats
    kernels = defaultdict(lambda: [0, 0.0])  # name -> [calls, us]
    for e in prof.events():
        if (e.device_type == DeviceType.CUDA) if cuda else (e.cpu_parent is None):
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.device_time if cuda else e.cpu_time
    rows = sorted(
        ({"name": n, "kind": kind_of(n), "calls": c / repeats, "us": us / repeats}
         for n, (c, us) in kernels.items()),
        key=lambda r: -r["us"],
    )  # fmt: skip
    kinds = defaultdict(lambda: {"calls": 0.0, "us": 0.0})
    for r in rows:
        kinds[r["kind"]]["calls"] += r["calls"]
        kinds[r["kind"]]["us"] += r["us"]
    kernel_us = sum(r["us"] for r in rows) if cuda else wall_us
    return {"wall_us": wall_us, "kernel_us": kernel_us, "gap_us": wall_us - kernel_us,
            "kernels": rows, "kinds": dict(kinds)}  # fmt: skip


def print_profile(title: str, p: dict, floor_us: float, top: int = 12) -> None:
    over = p["wall_us"] / floor_us
    print(f"{title}: {p['wall_us']:.0f} us a step ({over:.2f}x the floor of {floor_us:.0f} us), "
          f"kernels {p['kernel_us']:.0f} us, gaps {p['gap_us']:.0f} us")  # fmt: skip
    for kind, k in sorted(p["kinds"].items(), key=lambda kv: -kv[1]["us"]):
        print(f"  {kind:<24} {k['calls']:>7.1f} kernels {k['us']:>9.1f} us")
    for r in p["kernels"][:top]:
        print(f"    {r['us']:>8.1f} us {r['calls']:>6.1f}x  {r['name'][:90]}")
