# Sourced by the device jobs: the environment the .device/ setup calls leave on the H200 machine.
find /tmp/site/ray/core/src -type f ! -name "*.py" -exec chmod +x {} + 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
M=/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
D=${DRAFTER:-speculative/drafters/smollm2-135m}
DATA=deployments/data/gsm8k/test.jsonl.gz  # the shipped GSM8K test questions
quiet() { grep -v -i "warn\|dequantiz\|FrontendNotFound\|dashboard\|it/s\]\|USDT" | tail -${1:-20}; }
