#!/usr/bin/env bash
# The GPU checks, and a change against its base on one GPU (is it slower?). PARTS picks, each in
# its own device call:
#   checks  tests/test_gpu.py on this tree (graphs equal eager, speculative equals plain, no host
#           sync, the eager verification after the graphed target pass, ...)
#   bench   eagleserve bench, plain and EAGLE-3 K=5, overlap on, graphs on, batch 1, 8, 32, GSM8K
#           test prompts, 256 tokens: the base checkout (.device/base, `git archive <base> | tar
#           -x`) and this tree, one after the other (ROUNDS="1 2": base, head, base, head) on the
#           same warm machine; TREES lists other NAME:DIR checkouts to bench in turn
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
ROOT=$PWD
PARTS=" ${PARTS:-checks bench} "
if [[ "$PARTS" == *" checks "* ]]; then
    EAGLESERVE_GPU_MODEL=$M EAGLESERVE_GPU_DRAFTER=$D timeout ${CHECKS_TIMEOUT:-500} python3 tests/test_gpu.py 2>&1 \
        | tee $OUT/gpu_checks.log | quiet 14
fi
bench() {  # NAME TREE
    (cd "$2" && PYTHONPATH=/tmp/site:$PWD timeout ${BENCH_TIMEOUT:-280} python3 -m deployments.cli bench \
        --model $M --drafter "$ROOT/$D" --dataset "$ROOT/$DATA" --output-len ${OUTPUT_LEN:-256} \
        --num-prompts 32 --batch 1,8,32 --modes plain,eagle -k 5 --overlap on --cuda-graphs on \
        -o $OUT/bench_$1.json 2>&1 | quiet 8)
}
if [[ "$PARTS" == *" bench "* ]]; then
    for round in ${ROUNDS:-1}; do
        for tree in ${TREES:-base:.device/base head:.}; do  # NAME:DIR, in this order
            bench ${tree%%:*}_$round ${tree#*:}
        done
    done
fi
