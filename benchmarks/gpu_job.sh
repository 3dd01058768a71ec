#!/usr/bin/env bash
# The H200 measurement job (issue 6). Parts, in priority order (PARTS="..." picks some; default all),
# each skipped once the time budget ($BUDGET seconds, default 540) would be overrun. All parts take
# ~800 s, more than one device call may run (600 s): split them over two calls with PARTS.
#   graphs    plain, EAGLE-3 K=3 with and without overlap; batch 1, 8, 32; CUDA graphs
#   firstdraft EAGLE-3 K=3 and K=5 with overlap, the whole decode step as one graph (--graph-first-draft)
#   hf        Hugging Face generate (plain, prompt lookup) on the same prompts
#   k5        EAGLE-3 K=5 with and without overlap
#   gqa       plain and EAGLE-3 K=3 with every attention folded (EAGLESERVE_GQA=0), for the A/B against graphs
#   eager     the graphs-off grid: plain and EAGLE-3 K=3, overlap on and off, batch 1, 8, 32
#   floor     per-step time against the weight-reading floor (8B-shaped random weights, SmolLM2)
# The GPU checks run in benchmarks/profile_job.sh. Run on the device machine after the .device/
# setup calls; writes JSON under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
END=$((SECONDS + ${BUDGET:-540}))
PARTS=" ${PARTS:-graphs gqa k5 hf firstdraft eager floor} "
part() {  # part NAME SECONDS_NEEDED command...
    local name=$1 need=$2; shift 2
    [[ "$PARTS" == *" $name "* ]] || return
    if (( SECONDS + need > END )); then echo "skipped (time budget): $name"; return; fi
    echo "== $name"
    timeout $((END - SECONDS)) "$@" 2>&1 | quiet 16
}
# 32 requests per level at least: with 8, a batch-8 EAGLE-3 level ran for 0.6 s, where a 60 ms stall is 10%
BENCH="python3 -m deployments.cli bench --model $M --drafter $D --dataset $DATA --output-len 256 --num-prompts 32"
part graphs 180 $BENCH --batch 1,8,32 -k 3 --overlap both --cuda-graphs on -o $OUT/bench_graphs.json
EAGLESERVE_GQA=0 part gqa 80 $BENCH --batch 8,32 -k 3 --overlap on --cuda-graphs on -o $OUT/bench_folded_attention.json
part firstdraft 100 $BENCH --batch 1,8,32 -k 3,5 --overlap on --cuda-graphs on --modes eagle --graph-first-draft \
    -o $OUT/bench_first_draft_graphed.json
part hf 60 python3 benchmarks/hf_reference.py --model $M --dataset $DATA -o $OUT/hf_reference.json
part k5 90 $BENCH --batch 1,8,32 -k 5 --overlap both --cuda-graphs on --modes eagle -o $OUT/bench_k5.json
# eager steps are ~10x slower: 8 requests per level keep this part within its budget
part eager 150 $BENCH --num-prompts 8 --batch 1,8,32 -k 3 --overlap both --cuda-graphs off --modes plain,eagle -o $OUT/bench_eager.json
part floor 90 python3 benchmarks/step_floor.py -o $OUT/step_floor_8b.json
part floor 30 python3 benchmarks/step_floor.py --model $M --drafter $D -o $OUT/step_floor_smollm2.json
# At most 8 files come back from the device machine: more travel as one tar.
if (( $(ls $OUT | wc -l) > 8 )); then (cd $OUT && tar cf results.tar --remove-files *); fi
