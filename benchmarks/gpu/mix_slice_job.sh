#!/usr/bin/env bash
# One slice of SmolLM2-135M drafter training on a mix of corpora, in one call of under 9 minutes
# on one H100 (or H200), each slice continuing the last (speculative/train/smollm2_mix.json):
#   synthetic  the target's own conversations (.device/mix/synthetic.jsonl.gz: the project's
#              synthetic corpus, 15,335 conversations), made into parts here;
#   distilled  the target's responses to the shipped drafter's training prompts, in their order
#              (.device/distilled/part-*.safetensors: `bash speculative/train/h200_job.sh distill`
#              returns a stretch of them a call in $OUT/data; DISTILL_SKIP continues the order).
# Weights MIX_SYNTH and MIX_DISTILLED (default 1 and 1: each sequence once an epoch); ablations
# TTT (unrolled steps), LR, VOCAB (draft vocabulary; the first slice only), TRAIN_S (default 240).
# The first slice starts from the shipped drafter; a later one continues the hand-over the last
# returned: `tar xf json.tar -C .device/mix handover` and, for each $OUT/handover-X, copy it to
# .device/mix/handover/X.
# At the end, acceptance of the new drafter beside the shipped one on every shipped set
# (benchmarks/acceptance.py: EAGLE sets, GSM8K test, held-out writing and code; K=3 and 5, greedy
# and 0.7; ACC_N prompts a set, default 32).
# Back under $OUT (at most 8 files under 16 MiB): the drafter in the shipped int8 layout
# (drafter-*.safetensors, its shards under 15 MB), the optimizer-free bfloat16 hand-over
# (handover-*.safetensors), and json.tar (drafter and hand-over JSON, acceptance.json, job.log).
# Run from the repo root after the .device/ setup calls (carry .device/wheels, .device/mix and
# .device/distilled with this one). TINY=1: a CPU dry run with a tiny random model.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
CONFIG=speculative/train/smollm2_mix.json
TRAIN_S=${TRAIN_S:-240} ACC_N=${ACC_N:-32} DEVICE=cuda ACC="--max-tokens 192 --max-batch-size 128"
BASELINE=speculative/drafters/smollm2-135m WORK=/tmp/mix K="3 5"
if [[ -n "${TINY:-}" ]]; then
    WORK=/tmp/mix-tiny DEVICE=cpu TRAIN_S=5 ACC_N=2 K=3
    ACC="--max-tokens 8 --max-batch-size 4 --sets gsm8k"  # the tiny target holds 1024 positions
    rm -rf $WORK && mkdir -p $WORK && python3 benchmarks/gpu/mix_tiny_inputs.py $WORK
    M=$WORK/target BASELINE=$WORK/baseline CONFIG=$WORK/mix.json
fi
mkdir -p $WORK/synthetic $WORK/distilled "$OUT"
SRC=${TINY:+$WORK/device}; SRC=${SRC:-.device}
zcat $SRC/mix/synthetic.jsonl.gz > $WORK/synthetic/synthetic.jsonl
cp $SRC/distilled*/part-*.safetensors $WORK/distilled/ 2>/dev/null
rm -rf $WORK/handover $WORK/drafter.ckpt*
[[ -f $SRC/mix/handover/trainer_state.json ]] && cp -r $SRC/mix/handover $WORK/handover
have=$(grep -c . $WORK/synthetic/synthetic.jsonl)
CORPORA="--corpus $WORK/synthetic=${MIX_SYNTH:-1} $WORK/distilled=${MIX_DISTILLED:-1}"
TRAIN="python3 -m deployments.cli -v train-drafter --config $CONFIG --model $M --device $DEVICE
    --data $WORK/synthetic -o $WORK/drafter --handover $WORK/handover --synthesize $have $CORPORA
    ${TTT:+--ttt-steps $TTT} ${LR:+--lr $LR}"
INIT="--init-from $BASELINE ${VOCAB:+--draft-vocab-size $VOCAB}"
[[ -d $WORK/handover ]] && INIT=
start=$(date +%s)
echo "== parts of $have synthetic conversations; $(ls $WORK/distilled | wc -l) distilled parts"
timeout 200 $TRAIN --data-only 2>&1 | tee -a "$OUT/job.log" | quiet 4
echo "== training slice (at most $TRAIN_S s) after $(( $(date +%s) - start )) s"
timeout $((TRAIN_S + 150)) $TRAIN --time-limit $TRAIN_S $INIT 2>&1 | tee -a "$OUT/job.log" | quiet 8
echo "== acceptance, new beside the shipped drafter, after $(( $(date +%s) - start )) s"
timeout 240 python3 benchmarks/acceptance.py --model $M --drafter $BASELINE $WORK/drafter \
    --num-gsm8k-test $ACC_N --num-heldout $ACC_N --k $K --temperatures 0 0.7 $ACC \
    --device $DEVICE --output $WORK/drafter/acceptance.json 2>&1 | tee -a "$OUT/job.log" | grep "^|"
for f in $WORK/drafter/*.safetensors; do cp "$f" "$OUT/drafter-$(basename $f)"; done
for f in $WORK/handover/*.safetensors; do cp "$f" "$OUT/handover-$(basename $f)"; done
cp "$OUT/job.log" $WORK/drafter/job.log
tar cf "$OUT/json.tar" -C $WORK drafter/acceptance.json drafter/job.log \
    $(cd $WORK && ls drafter/*.json handover/*.json)
rm "$OUT/job.log"
echo "== done in $(( $(date +%s) - start )) s: $(ls $OUT | wc -l) files back"
ls -la "$OUT"
