#!/usr/bin/env bash
# Where a constrained step's milliseconds go, on one GPU in one device call (after the .device/
# setup calls: site + wheels, the SmolLM2 GGUF's three parts): benchmarks/grammar_profile.py,
# json_schema requests decoding together, plain and speculative (the shipped drafter, K=5), each
# warmed, then 30 steps under torch.profiler: the host's grammar pieces, copies, syncs and the
# GPU's kernel time a step. Parts in priority order under $BUDGET seconds (default 420).
# TINY=1 bash benchmarks/gpu/grammar_profile_job.sh: the CPU dry run (batch 2, 3 steps).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/grammar}
BUDGET=${BUDGET:-420} PARTS=" ${PARTS:-b8 b32 b1} " JOB_LOG="$OUT/grammar_job.log"
source benchmarks/gpu/job_setup.sh
PROFILE="python3 benchmarks/grammar_profile.py"
if [[ -n "$TINY_FLAG" ]]; then
    part b8 120 $PROFILE --device cpu --batch 2 --steps 3 -o "$OUT/grammar_profile_b2.json"
    exit
fi
PROFILE="$PROFILE --device cuda --model $M --drafter $D --steps 30"
part b8 120 $PROFILE --batch 8 -o "$OUT/grammar_profile_b8.json"
part b32 120 $PROFILE --batch 32 -o "$OUT/grammar_profile_b32.json"
part b1 100 $PROFILE --batch 1 -o "$OUT/grammar_profile_b1.json"
