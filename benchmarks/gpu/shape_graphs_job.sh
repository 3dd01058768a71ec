#!/usr/bin/env bash
# Every step shape in a CUDA graph on one GPU (H100 or H200), in one device call of under 10
# minutes: tests/test_gpu.py's check of mixed-K and constrained steps in graphs (equal to eager),
# then benchmarks/shape_graphs.py: structured_speed.py at batch 1, 8 and 32, 128 tokens, with the
# graphs of constrained, lowered-K and mixed-K steps and without (EAGLESERVE_SHAPE_GRAPHS=0).
# JSON under $OUT, the table on stdout. Run after the .device/ setup calls (carry .device/wheels:
# xgrammar). TINY=1: a CPU dry run (batch 1 and 2, 8 tokens; graphs are CUDA's, so on and off
# run alike there).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/shape_graphs}
mkdir -p "$OUT"
if [[ -n "${TINY:-}" ]]; then
    ARGS=(--device cpu --batch 1,2 --max-tokens 8)
else
    source benchmarks/gpu/device_env.sh
    EAGLESERVE_GPU_MODEL=$M EAGLESERVE_GPU_DRAFTER=$D EAGLESERVE_GPU_TESTS=mixed_k_and_constrained \
        timeout ${CHECKS_TIMEOUT:-120} python3 tests/test_gpu.py 2>&1 | tee "$OUT/gpu_checks.log" \
        | quiet 4
    ARGS=(--device cuda --model "$M" --drafter "$D" --batch 1,8,32 --max-tokens 128
          --kv-cache-gb 1)
fi
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/shape_graphs.py --out-dir "$OUT" -- "${ARGS[@]}" \
    2>&1 | tee "$OUT/shape_graphs.log" | grep -v -i "warn\|dequantiz\|it/s\]" | tail -${LINES:-40}
echo "== exit ${PIPESTATUS[0]}"
