#!/usr/bin/env bash
# Where the GPU step time goes: the GPU checks, then a kernel-level profile of single steps
# (benchmarks/profile_step.py). Run on the device machine after the .device/ setup calls.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
EAGLESERVE_GPU_MODEL=$M EAGLESERVE_GPU_DRAFTER=$D timeout 150 python3 tests/test_gpu.py 2>&1 | quiet 12
timeout 200 python3 benchmarks/profile_step.py --model $M --drafter $D --dataset $DATA --batch ${BATCH:-1,8} \
    -o $OUT/profile_step.json 2>&1 | quiet 20
