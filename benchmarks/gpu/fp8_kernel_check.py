"""The paged kernel over an FP8 pool, compiled on the GPU (benchmarks/gpu/fp8_checks.py's
`kernel` part): its output against the gather path's (read_kv widening the FP8 rows and
scaling them, then SDPA in float32) at Llama-3.1-8B's attention shape with bf16 queries, and
its time over an FP8 pool against a bf16 one (CUDA graphs of 20 calls)."""

import torch
import torch.nn.functional as F

from benchmarks import paged_attention_gpu as pga
from speculative.draft_tree import tree_layout
from workers.layers.fp8 import to_fp8
from workers.layers.kv_cache import read_kv
from workers.layers.paged_attention import paged_attention

SCALE = (0.02, 0.01)  # pools of N(0, 1): up to about 250 of E4M3's 448


def fp8_pool(pool: torch.Tensor) -> torch.Tensor:
    return torch.stack([to_fp8(pool[0], SCALE[0]), to_fp8(pool[1], SCALE[1])])


def reference(q, pool8, batch) -> torch.Tensor:
    """The gather path in float32 over the FP8 pool."""
    kv = read_kv(pool8, batch, SCALE, torch.float32)
    bias = pga.mask_bias(q.float(), batch)
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), kv[0], kv[1], attn_mask=bias, enable_gqa=True
    )
    return out.transpose(1, 2)


def check(tiny: bool) -> list[dict]:
    layer, context = ((4, 2, 32), 200) if tiny else ((32, 8, 128), 3000)
    dtype = torch.float32 if tiny else torch.bfloat16  # the interpreter's bf16 dots are wrong
    tree = tree_layout(3, 1)
    cases = [(1, None, None), (6, None, None), (6, None, 1), (6, None, 4), (7, tree, None)]
    rows = []
    for T, layout, splits in cases:
        q, pool, batch = pga.make_batch(3, T, *layer, context, dtype, layout)
        pool8 = fp8_pool(pool.float())
        out = paged_attention(q, pool8, batch, num_splits=splits, kv_scale=SCALE)
        error = (out.float() - reference(q, pool8, batch)).abs().max().item()
        rows.append({"dtype": str(dtype), "T": T, "tree": layout is not None,
                     "splits": splits or "default", "max_abs_error": error})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def speed(tiny: bool) -> list[dict]:
    layer, dtype = ((4, 2, 32), torch.float32) if tiny else ((32, 8, 128), torch.bfloat16)
    rows = []
    for B, context in [(1, 128), (2, 128)] if tiny else [(1, 1024), (1, 8192), (32, 8192)]:
        q, pool, batch = pga.make_batch(B, 6, *layer, context, dtype)
        pool8 = fp8_pool(pool.float())
        bf16_ms = pga.time_ms(lambda q=q, p=pool, b=batch: paged_attention(q, p, b))
        fp8_ms = pga.time_ms(lambda q=q, p=pool8, b=batch: paged_attention(q, p, b, kv_scale=SCALE))
        rows.append({"batch": B, "context": context, "tokens_per_row": 6,
                     "pool_dtype_ms": bf16_ms, "fp8_pool_ms": fp8_ms})  # fmt: skip
        print(rows[-1], flush=True)
        del q, pool, pool8, batch
    return rows


def run(args, device) -> dict:
    out = {"check": check(args.tiny), "speed": speed(args.tiny)}
    errors = [r["max_abs_error"] for r in out["check"]]
    out["table"] = [f"FP8 pool, kernel vs gather: max abs error {max(errors):.2e}"]
    out["table"] += [f"batch {r['batch']} context {r['context']}: {r['pool_dtype_ms']:.4f} ms "
                     f"over the model dtype's pool, {r['fp8_pool_ms']:.4f} ms over FP8"
                     for r in out["speed"]]  # fmt: skip
    return out
