#!/usr/bin/env bash
# Drafts that follow the grammar on one H100 (or H200): benchmarks/structured_speed.py at batch
# 1, 8 and 32, 128 tokens, SmolLM2 GGUF bf16, 2 rounds (about 5 minutes): json_schema, forced tool
# calls and free text on the same prompts, plain against EAGLE-3 K=5 with free drafts and with
# drafts that follow the grammar, and the draft masks' host ms per step. Writes
# $OUT/structured_drafts_gpu.json and prints the table, then each batch's ratios to free text
# (the goals: tokens/step >= 1x, tok/s >= 0.85x at batch 8). Run after the .device/ setup calls
# (carry .device/wheels: xgrammar). TINY=1: a CPU dry run (batch 1 and 2, 8 tokens).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
ARGS=(--device cuda --model "$M" --drafter "$D" --batch 1,8,32 --max-tokens 128 --rounds 2
      --kv-cache-gb 1)
if [[ -n "${TINY:-}" ]]; then
    ARGS=(--device cpu --model smollm2-135m --drafter default --batch 1,2 --max-tokens 8)
fi
timeout "${TIMEOUT:-460}" python3 benchmarks/structured_speed.py "${ARGS[@]}" \
    --out "$OUT/structured_drafts_gpu.json" 2>&1 | tee "$OUT/structured_drafts.log" | quiet 40
echo "== exit ${PIPESTATUS[0]}"
