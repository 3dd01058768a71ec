#!/usr/bin/env bash
# The GPU checks, and a change against its base on one GPU (is it slower?). PARTS picks, each in
# its own device call:
#   checks  tests/test_gpu.py on this tree (graphs equal eager, speculative equals plain, no host
#           sync, the eager verification after the graphed target pass, ...)
#   bench   eagleserve bench, plain and EAGLE-3 K=5, overlap on, graphs on, batch 1, 8, 32, GSM8K
#           test prompts, 256 tokens: the base checkout (.device/base, `git archive <base> | tar
#           -x`) and this tree, one after the other (ROUNDS="1 2": base, head, base, head) on the
#           same warm machine; TREES lists other NAME:DIR checkouts to bench in turn
#   generate  eagleserve generate, greedy, default drafter, the first 16 GSM8K test questions, 128
#           tokens, with each tree of TREES (default base, head): the outputs compared byte for
#           byte (generate_NAME.jsonl, generate_compare.json)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
ROOT=$PWD
PARTS=" ${PARTS:-checks bench} "
if [[ "$PARTS" == *" checks "* ]]; then
    EAGLESERVE_GPU_MODEL=$M EAGLESERVE_GPU_DRAFTER=$D timeout ${CHECKS_TIMEOUT:-500} python3 tests/test_gpu.py 2>&1 \
        | tee $OUT/gpu_checks.log | quiet 14
fi
bench() {  # NAME TREE
    (cd "$2" && PYTHONPATH=/tmp/site:$PWD timeout ${BENCH_TIMEOUT:-280} python3 -m deployments.cli bench \
        --model $M --drafter "$ROOT/$D" --dataset "$ROOT/$DATA" --output-len ${OUTPUT_LEN:-256} \
        --num-prompts 32 --batch 1,8,32 --modes plain,eagle -k 5 --overlap on --cuda-graphs on \
        -o $OUT/bench_$1.json 2>&1 | quiet 8)
}
if [[ "$PARTS" == *" bench "* ]]; then
    for round in ${ROUNDS:-1}; do
        for tree in ${TREES:-base:.device/base head:.}; do  # NAME:DIR, in this order
            bench ${tree%%:*}_$round ${tree#*:}
        done
    done
fi
generate() {  # NAME TREE
    (cd "$2" && PYTHONPATH=/tmp/site:$PWD timeout ${GENERATE_TIMEOUT:-150} python3 -m deployments.cli \
        generate "$ROOT/$OUT_PROMPTS" -o $OUT/generate_$1.jsonl --model $M --drafter "$ROOT/$D" \
        --max-tokens 128 --temperature 0 2>&1 | quiet 2)
}
if [[ "$PARTS" == *" generate "* ]]; then
    OUT_PROMPTS=.device/generate_prompts.jsonl
    python3 - "$DATA" "$OUT_PROMPTS" <<'PY'
import gzip, json, sys
rows = [json.loads(line) for line in gzip.open(sys.argv[1], "rt")][:16]
with open(sys.argv[2], "w") as f:
    for i, row in enumerate(rows):
        f.write(json.dumps({"id": i, "prompt": row["question"]}) + "\n")
PY
    names=()
    for tree in ${TREES:-base:.device/base head:.}; do
        generate ${tree%%:*} ${tree#*:}
        names+=(${tree%%:*})
    done
    python3 - $OUT "${names[@]}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
texts = {n: open(f"{out}/generate_{n}.jsonl", "rb").read() for n in names}
same = {n: texts[n] == texts[names[0]] for n in names[1:]}
rows = {n: len(t.splitlines()) for n, t in texts.items()}
json.dump({"reference": names[0], "byte_identical": same, "rows": rows},
          open(f"{out}/generate_compare.json", "w"), indent=1)
for n in names[1:]:
    print(f"generate: {n} vs {names[0]}: {'byte-identical' if same[n] else 'DIFFERENT'} "
          f"({rows[n]} rows)")
PY
fi
