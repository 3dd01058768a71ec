# Sourced by the GPU jobs in this folder: the environment the .device/ setup calls leave on the
# device machine (H100 or H200). Run the jobs from the repository root.
find /tmp/site/ray/core/src -type f ! -name "*.py" -exec chmod +x {} + 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
M=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
D=${DRAFTER:-speculative/drafters/smollm2-135m}
DATA=deployments/data/gsm8k/test.jsonl.gz  # the shipped GSM8K test questions
quiet() { grep -v -i "warn\|dequantiz\|FrontendNotFound\|dashboard\|it/s\]\|USDT" | tail -${1:-20}; }
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1  # else tvm-ffi may compile a torch addon at import
# the engine imports xgrammar, which the site bundle lacks: its cp312 wheels (xgrammar,
# apache-tvm-ffi, typing_extensions) travel in .device/wheels (benchmarks/device_wheels.sh fills
# it; carry it in one setup call)
if ! python3 -c "import xgrammar" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .device/wheels/*.whl || echo "no xgrammar: carry .device/wheels"
fi
