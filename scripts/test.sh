#!/usr/bin/env bash
# The README's test command: create/refresh .venv with the CPU build of torch, then run the suite.
# Two pytest processes, each taking whole test files (a file's cluster fixtures start once): most tests wait on real
# processes and sockets, so two share two cores well (10m39s -> 6m49s on the 2-core build machine). `-n 0` runs serially.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
python -m pytest -q -n 2 --dist loadfile "$@"
