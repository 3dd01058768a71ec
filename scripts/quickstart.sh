#!/usr/bin/env bash
# Fresh machine -> the embedded default model answering a request.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
printf '{"id": "q1", "prompt": "What is the capital of France? Answer in one sentence."}\n' > /tmp/eagleserve-quickstart.jsonl
eagleserve generate /tmp/eagleserve-quickstart.jsonl -o /tmp/eagleserve-quickstart.out.jsonl --max-tokens 64
cat /tmp/eagleserve-quickstart.out.jsonl
