#!/usr/bin/env bash
# Serving speed and acceptance on one GPU (BENCHMARKS.md, "Serving throughput" and "Acceptance").
# PARTS picks (default all), each in its own device call:
#   checks      tests/test_gpu.py (graphs equal eager, the draft tree included; no host sync)
#   acceptance  benchmarks/acceptance.py: K=3 and 5, greedy and T=0.7, siblings 0 (the chain), 1
#               and 2, on every set (the sets ship in deployments/data)
#   speed       eagleserve bench: plain, EAGLE-3 K=3 and K=5 with siblings 0 and 1, batch 1, 8, 32,
#               graphs, overlap
#   eagerverify eagleserve bench: EAGLE-3 K=5 greedy, sampled (T=0.8) and with logprobs, batch 1
#               and 8: what steps that verify eagerly after the graphed target pass cost (not run
#               yet; on 2026-12-05 logprobs were 10x slower, before that pass was graphed)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=" ${PARTS:-checks acceptance speed eagerverify} "
if [[ "$PARTS" == *" checks "* ]]; then
    EAGLESERVE_GPU_MODEL=$M EAGLESERVE_GPU_DRAFTER=$D timeout 400 python3 tests/test_gpu.py 2>&1 | quiet 12
fi
if [[ "$PARTS" == *" acceptance "* ]]; then
    timeout 500 python3 benchmarks/acceptance.py --model $M --drafter $D --k 3 5 --temperatures 0 0.7 \
        --siblings 0 1 2 --max-batch-size 128 --device cuda \
        --output $OUT/acceptance_tree.json 2>&1 | grep -v '^{' | quiet 16
fi
if [[ "$PARTS" == *" speed "* ]]; then
    timeout 560 python3 -m deployments.cli bench --model $M --drafter $D --dataset $DATA --output-len 256 \
        --num-prompts 32 --batch 1,8,32 -k 3,5 --draft-siblings 0,1 --overlap on --cuda-graphs on \
        -o $OUT/bench_tree.json 2>&1 | quiet 16
fi
if [[ "$PARTS" == *" eagerverify "* ]]; then
    eagerverify() {  # NAME [bench flags]
        timeout 180 python3 -m deployments.cli bench --model $M --drafter $D --dataset $DATA --output-len 128 \
            --num-prompts 16 --batch 1,8 -k 5 --modes eagle "${@:2}" -o $OUT/bench_eagerverify_$1.json 2>&1 | quiet 4
    }
    eagerverify greedy; eagerverify sampled --temperature 0.8; eagerverify logprobs --logprobs 1
fi
