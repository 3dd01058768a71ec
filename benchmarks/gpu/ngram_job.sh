#!/usr/bin/env bash
# Drafts without a drafter (--drafter ngram) on one GPU, in one device call of under 9 minutes
# (carry .device/site and .device/wheels; the SmolLM2 GGUF set up by the model calls):
# `eagleserve bench` with graphs and overlap on, 128 tokens, at batch 1, 8 and 32. Parts in
# priority order under $BUDGET seconds (default 480); PARTS="..." picks some. JSON under $OUT,
# each table on stdout.
#   sum    the summarisation set (the output repeats the article): plain, ngram K=3 and K=auto,
#          and the EAGLE-3 chain at K=5 beside them
#   gsm8k  the GSM8K test questions (little to copy): plain and ngram K=auto (auto must turn
#          the drafts off where they do not pay, so never slower than plain)
#   code   the held-out code set: plain and ngram K=3 and auto
# TINY=1 bash benchmarks/gpu/ngram_job.sh: the CPU dry run (batch 1 and 2, 16 tokens).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/ngram}
BUDGET=${BUDGET:-480} PARTS=" ${PARTS:-sum gsm8k code} " JOB_LOG="$OUT/ngram_job.log"
source benchmarks/gpu/job_setup.sh
if [[ -n "$TINY_FLAG" ]]; then
    ARGS="--device cpu --batch 1,2 --output-len 16 --num-prompts 4"
else
    ARGS="--device cuda --batch 1,8,32 --output-len 128 --num-prompts 64 --model $M --drafter $D"
    ARGS="$ARGS --max-model-len 4096"  # the summarisation prompts: up to about 2k tokens
fi
BENCH="python3 -m deployments.cli bench $ARGS"
SUM=deployments/data/eagle_bench/sum.jsonl.gz
part sum 150 $BENCH --dataset $SUM --modes plain,ngram -k 3,auto -o "$OUT/ngram_sum.json"
part sum 60 $BENCH --dataset $SUM --modes eagle -k 5 -o "$OUT/eagle_sum.json"
part gsm8k 90 $BENCH --modes plain,ngram -k auto -o "$OUT/ngram_gsm8k.json"
part code 90 $BENCH --dataset deployments/data/heldout/code.jsonl.gz --modes plain,ngram \
    -k 3,auto -o "$OUT/ngram_code.json"
pack_results ngram_results
