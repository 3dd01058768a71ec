#!/bin/bash
# H200 commands: self-distill, train and export the SmolLM2-135M drafter (part "train"), then
# measure its acceptance (part "acceptance"); `h200_job.sh` alone runs both. Run from the repo
# root after the .device bundles are staged (see README in speculative/drafters/smollm2-135m).
# Writes the drafter, logs and results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
CONFIG=${CONFIG:-speculative/train/smollm2_135m.json}
MODEL=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTER=${DRAFTER_OUT:-/tmp/eagle/drafter}
PARTS=${*:-train acceptance}
mkdir -p /tmp/eagle "$OUT/drafter"
if [[ " $PARTS " == *" train "* ]]; then
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    python3 -m deployments.cli -v train-drafter --config "$CONFIG" 2>&1 | tee "$OUT/train.log" | grep -v "^\s*$" | tail -c 4000
    # at most 8 files of at most 16 MiB come back: the weight shards as they are, the JSON in one tar
    cp $DRAFTER.ckpt/vocab_coverage.json $DRAFTER/ 2>/dev/null
    cp $DRAFTER/*.safetensors "$OUT/drafter/"
    (cd $DRAFTER && tar cf "$OUT/drafter/json.tar" *.json)
fi
if [[ " $PARTS " == *" acceptance "* ]]; then
    python3 benchmarks/acceptance.py --model "$MODEL" --drafter $DRAFTER --k ${BENCH_K:-3 5} --temperatures ${BENCH_T:-0 0.7} \
        --max-batch-size 128 --data-root .device/data --device cuda \
        --output "$OUT/acceptance.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^{\|it/s\]" | tail -c 3000
fi
ls -la "$OUT" "$OUT/drafter"
