"""Compiles the Triton attention kernels for an H100 (sm_90) on a machine without a GPU (pip's
Triton ships ptxas), so what only the compiler refuses (a Python global read in a kernel, a type
the interpreter lets pass, tiles past the SM's shared memory) fails in CI. Run as a script, with
TRITON_INTERPRET unset: tests/test_paged_prefill.py runs it in a subprocess. Prints a line a
kernel: its name and the shared memory it takes."""

import os
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workers.layers import paged_attention, paged_prefill  # noqa: E402

FLOATS = ("scale", "scale_log2", "v_scale")


def compile_kernel(fn, pointers: dict, constants: dict, num_warps: int, num_stages: int) -> int:
    """-> the shared memory of fn compiled for sm_90 (every other argument an int32)."""
    names = fn.arg_names
    signature = {
        n: pointers.get(n) or ("constexpr" if n in constants else "fp32" if n in FLOATS else "i32")
        for n in names
    }
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options
    )
    return kernel.metadata.shared


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") == "0", "run without the interpreter"
    io = dict(m_ptr="*fp32", l_ptr="*fp32", table_ptr="*i64", pos_ptr="*i64", sinks_ptr="*fp32")
    tiles = paged_prefill.WIDE_TILES
    common = dict(GROUP=4, D=128, D_P2=128, BS=16, BLOCK_N=tiles.block_n, MIN_SPLIT=128)
    prefills = (  # (name, KV dtype, split, gpt-oss's window and sinks)
        ("prefill bf16", "*bf16", False, False),
        ("prefill bf16 window sinks", "*bf16", False, True),
        ("prefill fp8 split", "*fp8e4nv", True, False),
    )
    for name, kv, split, gpt_oss in prefills:
        pointers = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, out_ptr="*fp32" if split else "*bf16")
        constants = dict(common, BLOCK_M=tiles.block_m, SPLIT=split, PRECISION="tf32")
        constants |= dict(WINDOW=128 if gpt_oss else 0, HAS_SINKS=gpt_oss)
        shared = compile_kernel(
            paged_prefill._paged_prefill_kernel, pointers | io, constants, *tiles[2:]
        )
        print(name, shared)
    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*fp32")
    pointers |= io | dict(root_ptr="*i64", tree_ptr="*i8")
    constants = dict(common, BLOCK_M=64, HAS_TREE=True, SPLIT=True, PRECISION="tf32")
    constants |= dict(WINDOW=128, HAS_SINKS=True)
    print("decode tree split", compile_kernel(
        paged_attention._paged_attention_kernel, pointers, constants, 4, 3
    ))  # fmt: skip
    pointers = dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*bf16")
    pointers |= dict(sinks_ptr="*fp32")
    constants = dict(GROUP=4, D=128, D_P2=128, BLOCK_M=tiles.block_m, HAS_SINKS=True)
    print("combine", compile_kernel(
        paged_attention._combine_splits_kernel, pointers, constants, 4, 3
    ))  # fmt: skip


if __name__ == "__main__":
    main()
