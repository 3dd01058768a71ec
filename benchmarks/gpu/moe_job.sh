#!/usr/bin/env bash
# A mixture-of-experts target on one GPU, in one device call of under 9 minutes (carry
# .device/site and .device/wheels; no GGUF needed). Parts in priority order, each under its own
# timeout, skipped once the budget ($BUDGET seconds, default 500) would be overrun; PARTS="..."
# picks some. JSON under $OUT, a table of each part on stdout.
#   kernel  the fused MoE kernel against the loop over experts and the experts' read floor at
#           Qwen3-30B-A3B's and Mixtral-8x7B's layers, bf16 and FP8, with a block sweep
#           (moe_kernel_bench.py; it checks bf16 against the loop and graph replay against eager)
#   plain   step_floor.py on a Qwen3-30B-A3B-shaped target (random weights), no drafter, batch
#           1, 8, 32 at 1k: plain decode against its floor (the weights but the experts, plus
#           the experts the batch routes to, read once)
#   verify  the same target with a random EAGLE-3 head at K = 1..5: the verify pass of K + 1
#           tokens a row against plain's step (what auto K's costs must say for MoE)
#   fp8     plain decode with --quantization fp8 (FP8 experts and linear layers)
#   gptoss  a gpt-oss-20b-shaped target (sinks, 128-token windows in every other layer, 32
#           experts with biases): plain decode against its floor, and the verify pass at K=3,
#           at 1k and at 8k (where the windowed layers read 128 keys, not 8k)
# Then moe_summary.py prints verify(K) / plain per batch; past 8 files, $OUT travels as one tar.
# TINY=1 bash benchmarks/gpu/moe_job.sh: the CPU dry run (tiny shapes, Triton's interpreter).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/moe}
BUDGET=${BUDGET:-500} PARTS=" ${PARTS:-kernel plain verify fp8 gptoss} " JOB_LOG="$OUT/moe_job.log"
source benchmarks/gpu/job_setup.sh
MODEL=random:hf-qwen3-30b-a3b
[[ -n "$TINY_FLAG" ]] && MODEL=random:tiny-qwen3-moe
FLOOR="python3 benchmarks/step_floor.py $TINY_FLAG --model $MODEL --kv-gib 4"
[[ -z "$TINY_FLAG" ]] && FLOOR="$FLOOR --batch 1 8 32 --context 1024"
part kernel 150 python3 benchmarks/gpu/moe_kernel_bench.py $TINY_FLAG -o "$OUT"
part plain 60 $FLOOR --drafter none -o "$OUT/moe_plain_bf16.json"
for K in 1 2 3 4 5; do
    part verify 50 $FLOOR -k $K -o "$OUT/moe_verify_k$K.json"
done
part fp8 60 $FLOOR --drafter none --quantization fp8 -o "$OUT/moe_plain_fp8.json"
GPT_OSS=random:hf-gpt-oss-20b
[[ -n "$TINY_FLAG" ]] && GPT_OSS=random:tiny-gpt-oss
OSS_FLOOR="${FLOOR/--model $MODEL/--model $GPT_OSS}"
[[ -z "$TINY_FLAG" ]] && OSS_FLOOR="$OSS_FLOOR --context 1024 8192"
part gptoss 60 $OSS_FLOOR --drafter none -o "$OUT/gpt_oss_plain.json"
part gptoss 60 $OSS_FLOOR -k 3 -o "$OUT/gpt_oss_verify_k3.json"
python3 benchmarks/gpu/moe_summary.py "$OUT"
pack_results moe_results
