#!/usr/bin/env bash
# FP8 weights and the FP8 KV cache on one GPU, in one device call of under 8 minutes (carry
# .device/site and .device/wheels: the device bundle (.device/site) and
# benchmarks/device_wheels.sh build them; no GGUF needed). Parts in priority order, each under
# its own timeout, skipped once the budget ($BUDGET seconds, default 450) would be overrun;
# PARTS="..." picks some. JSON under $OUT, a table of each part on stdout.
#   wo        the weight-only FP8 kernel against _scaled_mm, bf16 and the floor at 8B's shapes and
#             M = 1..512, a sweep of its block configurations (fp8_weight_only_bench.py)
#   profile   step_floor.py --profile without a drafter at 1k, bf16 and FP8: the decode step kernel
#             by kernel, grouped by kind, and the gaps between kernels
#   gemm      torch._scaled_mm against the fallback at Llama-3.1-8B's shapes; a CUDA graph replay
#   kernel    the compiled paged kernel over an FP8 pool against the gather path; its time
#   tests     tests/test_paged_attention.py's FP8 cases and tests/test_fp8_weight_only.py compiled
#             on CUDA (TRITON_INTERPRET=0)
#   floor     step_floor.py, 8B shape and a random EAGLE-3 head, K=5, batch 1, 8, 32 at 1k and 8k:
#             the verify pass with FP8 weights, then bf16 (against FP8's weight-read floor)
#   plain     step_floor.py without a drafter at 1k: plain decoding's tokens/s, FP8 and bf16
#   capacity  the KV tokens gpu_memory_utilization 0.9 leaves: bf16, FP8 KV, FP8 weights + KV
#   fp8kv     step_floor.py with FP8 weights and an FP8 KV cache (the KV read at 8k)
# TINY=1 bash benchmarks/gpu/fp8_gpu_job.sh: the CPU dry run (tiny shapes, Triton's interpreter).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/fp8}
BUDGET=${BUDGET:-450} JOB_LOG="$OUT/fp8_job.log"
PARTS=" ${PARTS:-wo tests plain profile floor gemm kernel capacity fp8kv} "
source benchmarks/gpu/job_setup.sh
CHECKS="python3 benchmarks/gpu/fp8_checks.py $TINY_FLAG -o $OUT"
FLOOR="python3 benchmarks/step_floor.py $TINY_FLAG --context 1024 8192"
[[ -n "$TINY_FLAG" ]] && FLOOR="python3 benchmarks/step_floor.py --tiny"
part wo 150 python3 benchmarks/gpu/fp8_weight_only_bench.py $TINY_FLAG -o "$OUT"
if python3 -c "import pytest" 2>/dev/null; then
    part tests 90 python3 -m pytest tests/test_fp8_weight_only.py tests/test_paged_attention.py \
        -k "fp8_pool or weight_only" -q -p no:cacheprovider
else
    echo "skipped (no pytest: carry .device/wheels from benchmarks/device_wheels.sh): tests"
fi
part plain 50 $FLOOR --drafter none --context 1024 --quantization fp8 -o "$OUT/step_floor_plain_fp8.json"
part plain 50 $FLOOR --drafter none --context 1024 -o "$OUT/step_floor_plain_bf16.json"
part profile 60 $FLOOR --drafter none --context 1024 --profile -o "$OUT/step_profile_bf16.json"
part profile 60 $FLOOR --drafter none --context 1024 --profile --quantization fp8 \
    -o "$OUT/step_profile_fp8.json"
part floor 100 $FLOOR --quantization fp8 -o "$OUT/step_floor_fp8.json"
part floor 100 $FLOOR -o "$OUT/step_floor_bf16.json"
part gemm 30 $CHECKS gemm
part kernel 60 $CHECKS kernel
part capacity 90 $CHECKS capacity
part fp8kv 80 $FLOOR --quantization fp8 --kv-cache-dtype fp8 -o "$OUT/step_floor_fp8kv.json"
$CHECKS summary 2>&1 | tail -20
pack_results fp8_results
