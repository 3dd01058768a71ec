"""Host time to launch a CUDA graph against its number of kernel nodes (tiny kernels, so the GPU
side stays short): what a step's graph launch costs the host, which bounds the decode loop when the
GPU work per step is small. Prints a table, writes JSON.

    python3 benchmarks/graph_launch_probe.py -o $OUT/graph_launch_probe.json
"""

import argparse
import json
import time

import torch


def launch_us(num_kernels: int, repeats: int = 200) -> dict:
    x = torch.zeros(64, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(num_kernels):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    host = []
    for _ in range(repeats):
        start = time.perf_counter()
        g.replay()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    start_event, end_event = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start_event.record()
    g.replay()
    end_event.record()
    torch.cuda.synchronize()
    host.sort()
    return {
        "kernels": num_kernels,
        "host_launch_us_p50": round(host[len(host) // 2] * 1e6, 1),
        "gpu_us": round(start_event.elapsed_time(end_event) * 1000, 1),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-o", "--output", default="graph_launch_probe.json")
    args = p.parse_args()
    rows = [launch_us(n) for n in (1, 50, 150, 300, 600, 900)]
    print(f"{'kernels':>8} {'host launch us':>15} {'GPU us':>8}")
    for r in rows:
        print(f"{r['kernels']:>8} {r['host_launch_us_p50']:>15} {r['gpu_us']:>8}")
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
