"""Attention inside CUDA graphs on the GPU: cuDNN SDPA with GQA (enable_gqa, queries strided from
the QKV projection, one [B, 1, T, S] mask for all heads) against folding each KV group's query heads
into the query length (copies of q, the mask and the output). Per (heads, B, T, S): microseconds per
call, replayed 100 times in one graph. Prints a table, writes JSON.

    python3 benchmarks/sdpa_probe.py -o $OUT/sdpa_probe.json
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def graphed_us(fn, calls: int = 100) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def case(H, KV, D, B, T, S, dev="cuda", dt=torch.bfloat16) -> dict:
    G = H // KV
    qkv = torch.randn(B, T, H + 2 * KV, D, device=dev, dtype=dt)
    k = torch.randn(B, S, KV, D, device=dev, dtype=dt).transpose(1, 2)
    v = torch.randn(B, S, KV, D, device=dev, dtype=dt).transpose(1, 2)
    pos = torch.randint(S // 2, S, (B, T), device=dev)
    bias = torch.zeros(B, 1, T, S, device=dev, dtype=dt).masked_fill_(
        torch.arange(S, device=dev) > pos[:, None, :, None], float("-inf")
    )

    def gqa():
        o = F.scaled_dot_product_attention(
            qkv[:, :, :H].transpose(1, 2), k, v, attn_mask=bias, enable_gqa=True
        )
        return o.transpose(1, 2).reshape(B, T, H * D)

    def fold():
        q = qkv[:, :, :H].reshape(B, T, KV, G, D).transpose(1, 2).reshape(B, KV, T * G, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=folded_bias)
        return o.reshape(B, KV, T, G * D).transpose(1, 2).reshape(B, T, H * D)

    folded_bias = (
        bias.unsqueeze(3).expand(B, 1, T, G, S).reshape(B, 1, T * G, S)
    )  # once per forward
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        err = (gqa().float() - fold().float()).abs().max().item()
        return {
            "H": H,
            "KV": KV,
            "B": B,
            "T": T,
            "S": S,
            "gqa_us": round(graphed_us(gqa), 2),
            "fold_us": round(graphed_us(fold), 2),
            "max_diff": err,
        }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-o", "--output", default="sdpa_probe.json")
    args = p.parse_args()
    rows = []
    shapes = [(B, T, S) for T in (1, 4, 6) for B in (1, 4, 8, 16, 32, 64) for S in (256, 1024)] + [
        (1, 256, 256),
        (4, 512, 512),
        (8, 256, 256),
        (1, 2048, 2048),
    ]
    for H, KV, D in ((9, 3, 64), (32, 8, 128)):
        for B, T, S in shapes:
            rows.append(case(H, KV, D, B, T, S))
            r = rows[-1]
            print(
                f"H{H:<3}KV{KV:<2}B{B:<4}T{T:<5}S{S:<5} gqa {r['gqa_us']:7.2f} us  fold "
                f"{r['fold_us']:7.2f} us  "
                f"{r['fold_us'] / r['gqa_us']:5.2f}x  diff {r['max_diff']:.3g}",
                flush=True,
            )
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
