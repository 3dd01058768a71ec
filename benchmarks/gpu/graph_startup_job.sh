#!/usr/bin/env bash
# Start-up time and CUDA-graph memory, the base tree against this one, on one H100 (or H200):
# benchmarks/graph_startup.py in each tree of TREES (NAME:DIR, default the base checkout
# .device/base (ab_job.sh's) then this tree), one engine start each at the default sizing
# (gpu_memory_utilization 0.9, 256 request slots, max_model_len 8192, SmolLM2 GGUF, default
# drafter), each in a fresh process with a fresh Triton cache, so each compiles its kernels.
# Writes $OUT/graph_startup_NAME.json and graph_startup.json, prints a table. About 2-3 minutes
# (at most STARTUP_TIMEOUT, default 170 s, a tree). TINY=1: a CPU dry run (no graphs on CPU).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
ROOT=$PWD
ARGS="--model $M --drafter $ROOT/$D"
if [[ -n "${TINY:-}" ]]; then
    ARGS="--model smollm2-135m --drafter default --device cpu --max-model-len 512"
    OUT=${OUT:-$(mktemp -d)}
fi
names=()
for tree in ${TREES:-base:.device/base head:.}; do
    name=${tree%%:*}
    names+=($name)
    echo "== $name (${tree#*:})"
    (cd "${tree#*:}" && TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:$PWD \
        timeout ${STARTUP_TIMEOUT:-170} python3 "$ROOT/benchmarks/graph_startup.py" $ARGS \
        --name $name --out $OUT/graph_startup_$name.json 2>&1 | tee $OUT/graph_startup_$name.log \
        | quiet 4)
done
python3 - $OUT "${names[@]}" <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
rows = [json.load(open(f"{out}/graph_startup_{n}.json")) for n in names
        if os.path.exists(f"{out}/graph_startup_{n}.json")]
json.dump(rows, open(f"{out}/graph_startup.json", "w"), indent=1)
print(f"{'tree':8} {'start s':>8} {'graphs':>7} {'step graphs':>11} {'buckets':>7} "
      f"{'graph MiB':>9} {'estimate MiB':>12} {'KV blocks':>9}")
for r in rows:
    print(f"{r['name']:8} {r['start_s']:8.1f} {r['num_graphs']:7d} {r['num_step_graphs']:11d} "
          f"{r['num_batch_buckets']:7d} {r['graph_mib']:9.1f} {r['graph_estimate_mib']:12.1f} "
          f"{r['num_blocks']:9d}")
PY
