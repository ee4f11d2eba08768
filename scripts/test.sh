#!/usr/bin/env bash
# The README's test command: create/refresh .venv with the CPU build of torch, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m pytest -q "$@"
