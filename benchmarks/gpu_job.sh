#!/usr/bin/env bash
# The H200 measurement job (issue 6): GPU checks, our bench (graphs and eager), HF reference,
# 8B-shaped step floor. Run on the device machine after the .device/ setup calls; writes $OUT.
set -uo pipefail
find /tmp/site/ray/core/src -type f ! -name "*.py" -exec chmod +x {} + 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
M=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
D=${DRAFTER:-speculative/drafters/smollm2-135m}
DATA=.device/data/gsm8k_test.jsonl
quiet() { grep -v -i "warn\|dequantiz\|FrontendNotFound\|dashboard" | tail -${1:-20}; }
python3 -m deployments.cli bench --model $M --drafter $D --dataset $DATA --batch 1,8,32 -k 3,5 --overlap both \
    --cuda-graphs on --num-prompts 8 --output-len 256 -o $OUT/bench_graphs.json 2>&1 | quiet 24
python3 -m deployments.cli bench --model $M --drafter $D --dataset $DATA --batch 8 -k 3 --overlap both \
    --cuda-graphs off --num-prompts 8 --output-len 128 -o $OUT/bench_eager.json 2>&1 | quiet 8
python3 benchmarks/hf_reference.py --model $M --dataset $DATA -o $OUT/hf_reference.json 2>&1 | quiet 6
python3 benchmarks/step_floor.py --model $M --drafter $D -o $OUT/step_floor_smollm2.json 2>&1 | quiet 7
python3 benchmarks/step_floor.py -o $OUT/step_floor_8b.json 2>&1 | quiet 7
