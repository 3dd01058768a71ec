#!/usr/bin/env bash
# Fresh machine -> the embedded default (SmolLM2-135M + its EAGLE-3 drafter) served on CPU by
# Ray Serve on 127.0.0.1:$PORT (default 8000), answering one chat request over HTTP; then a clean
# shutdown. About 1-2 minutes; ~2 GB of packages, ~530 MB of model cache in ~/.cache/eagleserve.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "quickstart: $*" >&2; }
bash scripts/setup.sh
PORT="${PORT:-8000}"
LOG="$(mktemp -t eagleserve-quickstart-XXXXXX.log)"
say "starting the server on 127.0.0.1:$PORT (log: $LOG; the first start converts the model once)"
eagleserve serve --port "$PORT" --device cpu >"$LOG" 2>&1 &
SERVER=$!
trap 'say "stopping the server"; kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    if ! kill -0 $SERVER 2>/dev/null; then
        say "the server exited; its log:"; tail -n 20 "$LOG" >&2; exit 1
    fi
    sleep 1
done
say "server ready; asking it a question (POST /v1/chat/completions)"
curl -sS --fail-with-body "http://127.0.0.1:$PORT/v1/chat/completions" \
    -H "Content-Type: application/json" -d '{
  "model": "smollm2-135m", "temperature": 0, "max_tokens": 64,
  "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}'
echo
