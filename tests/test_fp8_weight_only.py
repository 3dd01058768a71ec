"""The weight-only FP8 kernel (workers/layers/fp8_weight_only.py), run by Triton's interpreter on
CPU, against its reference (the FP8 weights widened to float32, times their row scales, plus the
bias) across row counts, column and K tails, split K and biases; and which path fp8_linear takes
at which size. float32 and float16 activations on CPU; bfloat16 on CUDA only (the interpreter
computes bfloat16 dots wrongly). On a GPU machine TRITON_INTERPRET=0 runs the compiled kernel."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's decorators run
pytest.importorskip("triton")

from paged_batches import DEVICE  # noqa: E402

from workers.layers import fp8  # noqa: E402
from workers.layers.fp8_weight_only import block_config, weight_only_product  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SHAPES = [  # (M, N, K): one row, tails of every block, several row tiles, K split
    (1, 48, 64),
    (5, 100, 130),
    (16, 64, 256),
    (17, 33, 96),
    (65, 160, 200),
    (130, 64, 128),
    (3, 64, 4096),
]


def reference(x, w8, scale, bias):
    out = x.float() @ (w8.float() * scale[:, None]).t()
    return out if bias is None else out + bias.float()


def random_operands(M, N, K, dtype, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w8, scale = fp8.quantize_rows(torch.randn(N, K, generator=g).to(DEVICE) * 0.05)
    bias = torch.randn(N, generator=g).to(DEVICE, dtype) if with_bias else None
    return x, w8, scale, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_kernel_matches_the_widened_reference(M, N, K, dtype):
    for with_bias, num_sms, swap in ((False, 132, False), (True, 4, True)):  # few SMs: K split
        x, w8, scale, bias = random_operands(M, N, K, dtype, with_bias, seed=M * N + K)
        config = block_config(M, N, K, num_sms)[:6] + (swap,)  # both operand orders
        out = weight_only_product(x, w8, scale, bias, num_sms, config)
        assert out.dtype == dtype and out.shape == (M, N)
        expected = reference(x, w8, scale, bias)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max())


def test_blocks_are_the_measured_best_at_8bs_shapes():
    """block_config against the H100 sweep's best (benchmarks/results/2026-12-07-h100/)."""
    best = {  # (M, N, K) -> the sweep's fastest configuration
        (1, 6144, 4096): (16, 64, 128, 4, 8, 3, False),  # qkv
        (8, 4096, 4096): (16, 64, 128, 4, 8, 3, False),  # o
        (1, 28672, 4096): (16, 32, 128, 1, 4, 3, False),  # gate_up: columns fill the SMs
        (8, 4096, 14336): (16, 64, 256, 4, 8, 4, False),  # down
        (48, 6144, 4096): (64, 128, 128, 4, 4, 3, False),
        (48, 4096, 4096): (64, 64, 128, 4, 4, 3, False),
        (48, 28672, 4096): (64, 128, 128, 1, 4, 3, False),
    }  # fmt: skip
    for (M, N, K), config in best.items():
        assert block_config(M, N, K, 132)[:5] == config[:5], (M, N, K)
    split = block_config(1, 512, 14336, 132)[3]
    assert split > 1 and 14336 // split >= 1024


def test_split_k_sums_in_a_fixed_order():
    """The same inputs give the same bits, split or not split alike (no atomics)."""
    x, w8, scale, bias = random_operands(3, 64, 4096, torch.float32, True, seed=7)
    runs = [weight_only_product(x, w8, scale, bias, num_sms=2) for _ in range(2)]
    assert block_config(3, 64, 4096, 2)[3] > 1 and torch.equal(runs[0], runs[1])


def test_fp8_linear_is_weight_only_outside_prefill(monkeypatch):
    """A step's rows are not quantized, however many (the product equals the widened
    reference); a prefill forward's are, and every forward's with EAGLESERVE_FP8_WEIGHT_ONLY=0
    (each token rounded to E4M3 at its own scale)."""
    x, w8, scale, bias = random_operands(300, 48, 64, torch.float32, True, seed=3)
    x, w8, scale, bias = x.cpu(), w8.cpu(), scale.cpu(), bias.cpu()
    exact = reference(x, w8, scale, bias)
    for rows in (1, 300):
        torch.testing.assert_close(fp8.fp8_linear(x[:rows], w8, scale, bias), exact[:rows])
    with fp8.prefill_forward():
        prefill = fp8.fp8_linear(x, w8, scale, bias)
    assert not torch.allclose(prefill, exact, rtol=1e-4, atol=1e-4)  # rounded activations
    torch.testing.assert_close(prefill, exact, rtol=0.1, atol=0.1 * exact.abs().max())
    torch.testing.assert_close(fp8.fp8_linear(x, w8, scale, bias), exact)  # prefill is over
    monkeypatch.setenv("EAGLESERVE_FP8_WEIGHT_ONLY", "0")
    torch.testing.assert_close(fp8.fp8_linear(x, w8, scale, bias), prefill)


def test_cuda_takes_the_kernel_where_triton_widens_e4m3(monkeypatch):
    """On CUDA the weight-only kernel runs from compute capability 8.9 (Ada, Hopper); older GPUs
    quantize the activations in every forward instead (never a mix of the two)."""
    cuda = torch.device("cuda")
    for capability, weight_only in (((8, 0), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        fp8.weight_only_kernel_available.cache_clear()
        assert fp8.uses_weight_only(cuda) == weight_only
        with fp8.prefill_forward():
            assert not fp8.uses_weight_only(cuda)
    fp8.weight_only_kernel_available.cache_clear()
