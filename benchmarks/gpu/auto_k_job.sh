#!/usr/bin/env bash
# num_draft_tokens auto against K = 1, 3, 5 (and plain decoding) on one GPU, in one device call
# of under 8 minutes: benchmarks/auto_k.py at batch 1, 8 and 32, 128 tokens, GSM8K test prompts,
# graphs and overlap on. JSON under $OUT (auto_k.json: the summary; auto_k_bench.json: the
# runs), the table on stdout. Mixed-K and lowered-K steps replay their own graphs
# (workers/cuda_graphs.py: verify_by_width, draft_depth); AUTO_EAGER=1, in a call of its own,
# runs auto alone with those graphs off (EAGLESERVE_SHAPE_GRAPHS=0), to compare.
# TINY=1 bash benchmarks/gpu/auto_k_job.sh: the CPU dry run (batch 1 and 2, 16 tokens).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/auto_k}
mkdir -p "$OUT"
if [[ -n "${TINY:-}" ]]; then
    ARGS="--device cpu --batch 1,2 --output-len 16 --num-prompts 4"
else
    source benchmarks/gpu/device_env.sh
    ARGS="--device cuda --batch 1,8,32 --output-len 128 --num-prompts 64 --model $M --drafter $D"
    ARGS="$ARGS --dataset $DATA"
fi
if [[ -n "${AUTO_EAGER:-}" ]]; then
    EAGLESERVE_SHAPE_GRAPHS=0 timeout ${BENCH_TIMEOUT:-300} python3 -m deployments.cli bench \
        --modes eagle -k auto $ARGS -o "$OUT/auto_eager.json" 2>&1 \
        | grep -v -i "warn\|dequantiz\|it/s\]" | tail -8
    exit
fi
timeout ${BENCH_TIMEOUT:-450} python3 benchmarks/auto_k.py $ARGS -o "$OUT/auto_k.json" 2>&1 \
    | grep -v -i "warn\|dequantiz\|it/s\]" | tail -20
