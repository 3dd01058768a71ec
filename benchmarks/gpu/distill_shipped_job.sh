#!/usr/bin/env bash
# The target's responses to the shipped drafter's training prompts, regenerated in the order its
# training_config.json records (prompt files, number of prompts, passes, prompt length limit), a
# stretch a call (DISTILL_S seconds of admitting prompts, default 420) on one H100 (or H200).
# Back under $OUT: the new data parts (part-*.safetensors, at most 6M tokens, 12 MB, each), the
# distilled corpus that benchmarks/gpu/mix_slice_job.sh mixes with the synthetic set: copy them
# to .device/distilled/ in order, renumbered after the parts already there. The next call
# continues the order: DISTILL_SKIP=N leaves out the N prompts the earlier parts hold (the sum of
# their sequences; `python3 -c "from speculative.train.data import load_data;
# print(len(load_data('.device/distilled')))"`).
# Run from the repo root after the .device/ setup calls; carry .device/wheels and .device/data
# (the project's training prompt files: train_prompts/prompts-00*.jsonl.gz, gsm8k/train.jsonl.gz).
# TINY=1: a CPU dry run with a tiny random model and a few prompts.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
CONFIG=speculative/drafters/smollm2-135m/training_config.json
DISTILL_S=${DISTILL_S:-420} DEVICE=cuda WORK=/tmp/distill FLAGS=
if [[ -n "${TINY:-}" ]]; then
    WORK=/tmp/distill-tiny DEVICE=cpu DISTILL_S=30
    rm -rf $WORK && mkdir -p $WORK
    python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path
from tiny_models import tiny_llama; tiny_llama(Path('$WORK/target'), layers=2)"
    M=$WORK/target FLAGS="--prompts deployments/data/gsm8k/test.jsonl.gz --num-prompts 4"
fi
mkdir -p $WORK/data "$OUT"
rm -f $WORK/data/part-*.safetensors
start=$(date +%s)
python3 -m deployments.cli -v train-drafter --config $CONFIG --model $M --device $DEVICE \
    --data $WORK/data -o $WORK/drafter --distill-only --distill-time-limit $DISTILL_S \
    ${DISTILL_SKIP:+--distill-skip $DISTILL_SKIP} $FLAGS 2>&1 | quiet 6
cp $WORK/data/part-*.safetensors "$OUT/"
echo "== $(ls $WORK/data | wc -l) parts in $(( $(date +%s) - start )) s"
ls -la "$OUT"
