#!/usr/bin/env bash
# The H200 measurement job (issue 6), in priority order, each part skipped once the time budget
# ($BUDGET seconds, default 540) is spent: our bench with CUDA graphs (plain, EAGLE-3 K=3 with and
# without overlap; batch 1, 8, 32), the HF reference, K=5, the eager runs, cuDNN in the graphs,
# the step floors (8B-shaped, SmolLM2); all of them fit BUDGET=570.
# The GPU checks run in benchmarks/profile_job.sh.
# Run on the device machine after the .device/ setup calls; writes JSON under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
END=$((SECONDS + ${BUDGET:-540}))
part() {  # part SECONDS_NEEDED command...
    local need=$1; shift
    if (( SECONDS + need > END )); then echo "skipped (time budget): $*"; return; fi
    timeout $((END - SECONDS)) "$@" 2>&1 | quiet 16
}
BENCH="python3 -m deployments.cli bench --model $M --drafter $D --dataset $DATA --output-len 256 --num-prompts 8"
part 120 $BENCH --batch 1,8,32 -k 3 --overlap both --cuda-graphs on -o $OUT/bench_graphs.json
part 60 python3 benchmarks/hf_reference.py --model $M --dataset $DATA -o $OUT/hf_reference.json
part 60 $BENCH --batch 1,8,32 -k 5 --overlap both --cuda-graphs on --modes eagle -o $OUT/bench_k5.json
part 150 $BENCH --batch 1,8,32 -k 3 --overlap both --cuda-graphs off --modes plain,eagle -o $OUT/bench_eager.json
# A/B: cuDNN attention inside the captured graphs (eager forwards never use it; see ModelRunner).
EAGLESERVE_CUDNN_IN_GRAPHS=1 part 60 $BENCH --batch 8,32 -k 3 --overlap on --cuda-graphs on -o $OUT/bench_cudnn_graphs.json
part 90 python3 benchmarks/step_floor.py -o $OUT/step_floor_8b.json
part 30 python3 benchmarks/step_floor.py --model $M --drafter $D -o $OUT/step_floor_smollm2.json
# At most 8 files come back from the device machine: more travel as one tar.
if (( $(ls $OUT | wc -l) > 8 )); then (cd $OUT && tar cf results.tar --remove-files *); fi
