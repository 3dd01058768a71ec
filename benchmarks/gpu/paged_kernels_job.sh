#!/usr/bin/env bash
# The Triton kernels over the paged pool on one GPU, in one device call of under 6 minutes (carry
# .device/site and .device/wheels; no GGUF needed). JSON and logs under $OUT, tables on stdout:
#   tests  tests/test_paged_prefill.py compiled on CUDA (TRITON_INTERPRET=0, bfloat16 included;
#          not float32 at head dim 128, whose kernels take 20 s each to compile)
#   bench  benchmarks/paged_kernels_gpu.py: the prefill kernel against gather + SDPA at 8k and
#          32k prompt chunks, split-KV decode against no split at batch 1 and 8, 8k to 128k
# TINY=1 bash benchmarks/gpu/paged_kernels_job.sh: the CPU dry run (tiny shapes, Triton's
# interpreter).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/paged_kernels}
source benchmarks/gpu/job_setup.sh
if python3 -c "import pytest" 2>/dev/null; then
    echo "== tests"
    timeout ${TESTS_TIMEOUT:-150} python3 -m pytest tests/test_paged_prefill.py -q \
        -k "not (dtype0 and 128)" -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -4
else
    echo "skipped (no pytest: carry .device/wheels from benchmarks/device_wheels.sh): tests"
fi
echo "== bench"
timeout ${BENCH_TIMEOUT:-180} python3 benchmarks/paged_kernels_gpu.py $TINY_FLAG --output "$OUT" \
    2>&1 | tee "$OUT/paged_kernels.log" | grep -v "^{" | tail -40
