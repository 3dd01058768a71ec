#!/usr/bin/env bash
# The benchmark scripts on one H100 (or H200). PARTS picks (default all: about 6 minutes, so split
# them over two device calls of at most 600 s: "floor families" and "structured paged", whose
# timeouts add up to 540 s each). Each part runs under its own timeout (seconds: FLOOR_TIMEOUT,
# ...), tees its log to $OUT/<part>.log and writes its JSON under $OUT:
#   floor       benchmarks/step_floor.py: the verify pass and the whole K=5 step of a
#               Llama-3.1-8B shape (random weights, yuhuili-shaped head, bf16, graphs) against
#               the weight-read floor; batch 1, 8, 32 x context 1k, 8k, 32k where the KV fits
#               in 60 GiB (32 x 32k does not). About 1 minute.
#   families    benchmarks/families_gpu.py: Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B shapes, graphs
#               against eager token for token (float32, bf16), decode steps at batch 1 and 8.
#               About 2 minutes.
#   structured  benchmarks/structured_speed.py: json_schema requests with and without EAGLE-3
#               K=5, batch 8 alone and mixed 4 + 4, SmolLM2 GGUF, bf16. Under a minute.
#   paged       benchmarks/paged_kv.py: prefix TTFT cold/cached (2500 tokens), longest stream
#               stall chunked/whole (6000 tokens), KV capacity at the default sizing, SmolLM2
#               GGUF, bf16; every engine but two sizes its pool by profiling. About 2-3
#               minutes.
# Run after the .device/ setup calls (device_env.sh). The engine imports xgrammar, which the site
# bundle lacks: carry .device/wheels (xgrammar 0.2.9, apache-tvm-ffi 0.1.15.post2 and
# typing_extensions 4.16.0, cp312 manylinux wheels, 4.6 MB). TINY=1: a CPU dry run of every part.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=" ${PARTS:-floor families structured paged} "
DEVICE="--device cuda"
STRUCTURED="--max-tokens 128 --rounds 3 --kv-cache-gb 1"  # 43k tokens; no profiling at start
PAGED="--repeats 3"
if [[ -n "${TINY:-}" ]]; then
    M=smollm2-135m DEVICE="--device cpu" STRUCTURED="--batch 2 --max-tokens 8"
    PAGED="--prefix-len 100 --long-len 200 --max-model-len 512 --budget 64 --stream-tokens 10"
    PAGED_TIMEOUT=${PAGED_TIMEOUT:-1200}  # 16 requests on two slots take minutes on a CPU
fi
part() {  # NAME TIMEOUT command...
    local name=$1 limit=$2
    shift 2
    [[ "$PARTS" == *" $name "* ]] || return 0
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | quiet 30
    echo "== $name: exit ${PIPESTATUS[0]}"
}
part floor "${FLOOR_TIMEOUT:-180}" python3 benchmarks/step_floor.py ${TINY:+--tiny} \
    -o "$OUT/step_floor_8b.json"
part families "${FAMILIES_TIMEOUT:-360}" python3 benchmarks/families_gpu.py ${TINY:+--tiny} \
    -o "$OUT/families_gpu.json"
part structured "${STRUCTURED_TIMEOUT:-150}" python3 benchmarks/structured_speed.py $DEVICE \
    --model "$M" --drafter "$D" $STRUCTURED --out "$OUT/structured_speed_gpu.json"
part paged "${PAGED_TIMEOUT:-390}" python3 benchmarks/paged_kv.py $DEVICE --model "$M" \
    --drafter "$D" $PAGED --out "$OUT/paged_kv_gpu.json"
