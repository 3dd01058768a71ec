#!/bin/bash
# H200 commands for the SmolLM2-135M drafter. Parts (`h200_job.sh PART...`; default "train acceptance"):
#   distill     self-distil one more stretch of the prompt order (DISTILL_S seconds, default 420) and
#               return the new data parts in $OUT/data (DISTILL_SKIP=N: the order's first N prompts are
#               left out, as when the parts that held them are lost; N counts positions in the order
#               after prompts over max_prompt_len are dropped, as the parts' sequences do;
#               DISTILL_WORKERS=N: N engine processes share the GPU)
#   train       train and export (distilling first when no data is there; TRAIN_S overrides the
#               config's training time limit; INIT_FROM=DIR starts from that drafter instead of a
#               fresh one: the committed one, or an earlier job's fp32 checkpoint with an output of
#               its own (INIT_FROM=/tmp/eagle/drafter.ckpt DRAFTER_OUT=/tmp/eagle/drafter2); RESUME=1
#               continues the checkpoint that an earlier train job left on a warm machine, which is
#               otherwise removed (INIT_FROM is then not passed: the checkpoint already started from it))
#   acceptance  measure the drafter's acceptance
#   stepspeed   training steps/s with the loss over every row against the loss rows only
#               (benchmarks/train_step_speed.py on the staged data)
#   stage       nothing but the copy of carried parts into /tmp/eagle/data, which every call does
#               first: a call of its own when the parts and .device/data exceed one call's carry
# Data parts travel between jobs in .device/distilled (and distilled2, ... once one call's carry is
# full): copy them there from $OUT/data and carry each folder, one call per folder. Run from the
# repo root after the .device bundles are staged (see README in
# speculative/drafters/smollm2-135m). Writes the drafter, logs and results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
CONFIG=${CONFIG:-speculative/train/smollm2_135m.json}
MODEL=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTER=${DRAFTER_OUT:-/tmp/eagle/drafter}
DATA=/tmp/eagle/data
PARTS=${*:-train acceptance}
mkdir -p $DATA "$OUT/drafter"
cp -n .device/distilled*/part-*.safetensors $DATA/ 2>/dev/null  # .device/distilled, distilled2, ...
TRAIN="python3 -m deployments.cli -v train-drafter --config $CONFIG --data $DATA -o $DRAFTER"
if [[ " $PARTS " == *" distill "* ]]; then
    before=$(ls $DATA/part-*.safetensors 2>/dev/null | wc -l)
    $TRAIN --distill-only --distill-time-limit ${DISTILL_S:-420} ${DISTILL_SKIP:+--distill-skip $DISTILL_SKIP} \
        ${DISTILL_WORKERS:+--distill-workers $DISTILL_WORKERS} 2>&1 | grep -v "^\s*$" | tail -c 2000
    mkdir -p "$OUT/data"
    ls $DATA/part-*.safetensors | tail -n +$((before + 1)) | xargs -r cp -t "$OUT/data/"
fi
if [[ " $PARTS " == *" train "* ]]; then
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
    # a new run, unless RESUME=1 (a warm machine keeps the last one; train-drafter refuses --init-from with it)
    if [[ -n "${RESUME:-}" ]]; then INIT_FROM=; else rm -rf $DRAFTER.ckpt $DRAFTER.ckpt.tmp; fi
    $TRAIN ${TRAIN_S:+--time-limit $TRAIN_S} ${INIT_FROM:+--init-from $INIT_FROM} 2>&1 | tee "$OUT/train.log" \
        | grep -v "^\s*$" | tail -c 4000
    # at most 8 files of at most 16 MiB come back: the weight shards as they are, the JSON in one tar
    cp $DRAFTER.ckpt/vocab_coverage.json $DRAFTER/ 2>/dev/null
    cp $DRAFTER/*.safetensors "$OUT/drafter/"
    (cd $DRAFTER && tar cf "$OUT/drafter/json.tar" *.json)
fi
if [[ " $PARTS " == *" stepspeed "* ]]; then
    python3 benchmarks/train_step_speed.py --device cuda --data $DATA --model "$MODEL" \
        --output "$OUT/train_step_speed.json" 2>&1 | grep -v "it/s\]" | tail -5
fi
if [[ " $PARTS " == *" acceptance "* ]]; then
    python3 benchmarks/acceptance.py --model "$MODEL" --drafter $DRAFTER --k ${BENCH_K:-3 5} --temperatures ${BENCH_T:-0 0.7} \
        --max-batch-size 128 --device cuda \
        --output "$OUT/acceptance.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^{\|it/s\]" | tail -c 3000
fi
ls -la "$OUT" "$OUT/drafter"
