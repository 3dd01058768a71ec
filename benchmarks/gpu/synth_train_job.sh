#!/usr/bin/env bash
# A drafter for SmolLM2-135M from no dataset, in slices of under 9 minutes on one H100 (or H200):
# the target writes conversations itself (`train-drafter --synthesize`, SYNTH_S seconds, default
# 140), then the drafter trains on every conversation the corpus holds (TRAIN_S, default 140,
# the LR schedule fitted to it), then benchmarks/acceptance.py compares it with the committed
# drafter on the held-out writing and code sets and GSM8K (K=3, greedy and 0.7; ACC_N prompts
# a set, default 48).
# What comes back under $OUT (at most 8 files of at most 16 MiB): synthetic.jsonl.gz (the corpus),
# drafter/ (bf16 shards + json.tar), acceptance.json, job.log. The next slice continues them: copy
# $OUT/synthetic.jsonl.gz to .device/synth/ and $OUT/drafter (untar json.tar) to
# .device/synth/drafter, carry .device/synth; the corpus then grows and training starts from that
# drafter (--init-from).
# SYNTH_S=0 skips synthesis (train on the carried corpus only).
# Run from the repo root after the .device/ setup calls (device_env.sh; carry .device/wheels).
# TINY=1: a CPU dry run with a tiny random model and tiny settings, about two minutes.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
CONFIG=speculative/train/smollm2_synth.json
SYNTH_S=${SYNTH_S:-140} TRAIN_S=${TRAIN_S:-140} ACC_N=${ACC_N:-48}
N=${N:-20000}  # conversations the corpus grows towards
DEVICE=cuda ACC="--max-tokens 192 --max-batch-size 128"
BASELINE=speculative/drafters/smollm2-135m
WORK=/tmp/synth  # speculative/train/smollm2_synth.json's output and data
if [[ -n "${TINY:-}" ]]; then
    WORK=/tmp/synth-tiny DEVICE=cpu N=6 SYNTH_S=1 TRAIN_S=5 ACC_N=2
    ACC="--max-tokens 8 --max-batch-size 4"
    rm -rf $WORK
    python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path
from tiny_models import tiny_llama; tiny_llama(Path('$WORK/target'), layers=4)"
    M=$WORK/target BASELINE=none
    printf '%s' '{"synthesize": {"max_batch_size": 2, "max_user_tokens": 12, "max_tokens": 12,
        "max_model_len": 192}, "draft_vocab_size": 256, "ttt_steps": 3, "batch_tokens": 1024,
        "max_steps": 4, "eval_num_prompts": 2, "eval_max_tokens": 8}' > $WORK/tiny.json
    CONFIG=$WORK/tiny.json
fi
mkdir -p $WORK/data "$OUT/drafter"
[[ -f .device/synth/synthetic.jsonl.gz ]] && zcat .device/synth/synthetic.jsonl.gz > $WORK/data/synthetic.jsonl
INIT=; [[ -f .device/synth/drafter/config.json ]] && INIT="--init-from .device/synth/drafter"
rm -rf $WORK/data/part-*.safetensors $WORK/drafter.ckpt*  # parts: rebuilt from the whole corpus
TRAIN="python3 -m deployments.cli -v train-drafter --config $CONFIG --model $M --device $DEVICE
    --data $WORK/data -o $WORK/drafter"
[[ -n "${TINY:-}" ]] || nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
start=$(date +%s)
if (( SYNTH_S > 0 )); then
    echo "== synthesis (at most $SYNTH_S s of rounds)"
    timeout $((SYNTH_S + 150)) $TRAIN --data-only --synthesize $N --synthesize-time-limit $SYNTH_S \
        2>&1 | tee -a "$OUT/job.log" | quiet 8
fi
have=$(grep -c . $WORK/data/synthetic.jsonl 2>/dev/null || echo 0)
echo "== training on $have conversations (at most $TRAIN_S s) after $(( $(date +%s) - start )) s"
(( have > 0 )) || { echo "no corpus"; exit 1; }
timeout $((TRAIN_S + 150)) $TRAIN --synthesize $have --time-limit $TRAIN_S $INIT 2>&1 \
    | tee -a "$OUT/job.log" | quiet 8
gzip -c $WORK/data/synthetic.jsonl > "$OUT/synthetic.jsonl.gz"
cp $WORK/drafter/*.safetensors "$OUT/drafter/" && (cd $WORK/drafter && tar cf "$OUT/drafter/json.tar" *.json)
echo "== acceptance, new against the committed drafter, after $(( $(date +%s) - start )) s"
timeout 200 python3 benchmarks/acceptance.py --model $M --drafter $BASELINE $WORK/drafter \
    --sets gsm8k --num-gsm8k-test 0 --num-heldout $ACC_N --k 3 --temperatures 0 0.7 $ACC \
    --device $DEVICE --output "$OUT/acceptance.json" 2>&1 | tee -a "$OUT/job.log" | grep "^|"
echo "== done in $(( $(date +%s) - start )) s"
ls -la "$OUT" "$OUT/drafter" | grep -v " work$"
