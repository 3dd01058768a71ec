#!/usr/bin/env bash
# Fresh machine -> the embedded default (SmolLM2-135M + its EAGLE-3 drafter) served on CPU by
# Ray Serve, answering one chat request over HTTP; then a clean shutdown.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT="${PORT:-8000}"
eagleserve serve --port "$PORT" --device cpu &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 $SERVER 2>/dev/null || { echo "server exited" >&2; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H "Content-Type: application/json" -d '{
  "model": "smollm2-135m", "temperature": 0, "max_tokens": 64,
  "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}'
echo
