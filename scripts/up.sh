#!/usr/bin/env bash
# The README's first command: create/refresh .venv (CPU torch 2.13.0), then start a local cluster
# (router + prefill worker + decode worker) on a tiny model pdserve generates itself. Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec pdserve up "$@"
