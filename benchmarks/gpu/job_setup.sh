# Sourced by the GPU jobs in this folder, from the repository root, after they set OUT (and
# BUDGET, PARTS and JOB_LOG where they run parts). TINY=1: the CPU dry run (TINY_FLAG=--tiny,
# Triton's interpreter); otherwise the device machine's setup (device_env.sh) and compiled
# Triton kernels.
#   part NAME SECONDS_NEEDED command...   runs a part named in $PARTS under what is left of
#       $BUDGET seconds (skipped once less than SECONDS_NEEDED is left), its output appended to
#       $JOB_LOG and its last lines on stdout
#   pack_results NAME                     at most 8 files come back from the device machine:
#       more travel as one tar, $OUT/NAME.tar
mkdir -p "$OUT"
TINY_FLAG=""
if [[ -n "${TINY:-}" ]]; then
    TINY_FLAG="--tiny"
    export TRITON_INTERPRET=1
else
    bash .device/site/setup.sh >/dev/null
    source benchmarks/gpu/device_env.sh
    export TRITON_INTERPRET=0
fi
export PYTHONUNBUFFERED=1
END=$((SECONDS + ${BUDGET:-450}))
part() {
    local name=$1 need=$2; shift 2
    [[ "$PARTS" == *" $name "* ]] || return 0
    if (( SECONDS + need > END )); then echo "skipped (time budget): $name"; return 0; fi
    echo "== $name ($((END - SECONDS)) s left)"
    timeout $((END - SECONDS)) "$@" 2>&1 | tee -a "$JOB_LOG" \
        | grep -v -i "warn\|it/s\]\|^{'" | tail -24
}
pack_results() {
    if (( $(ls "$OUT" | wc -l) > 8 )); then (cd "$OUT" && tar cf "$1.tar" --remove-files *); fi
}
