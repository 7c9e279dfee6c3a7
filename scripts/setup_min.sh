#!/usr/bin/env bash
# The venv for the core tests on the LOWEST releases the package declares (they prove the declared ranges true;
# scripts/test.sh runs them): .venv-min with requirements-min.txt (torch, accelerate, peft, safetensors, tokenizers) and
# pyproject.toml's lowest transformers, read from its `transformers>=X.Y,` requirement (any X.Y.* release), so the
# range and this check cannot drift apart (tests/repository/test_versions.py checks every other lower bound against
# requirements-min.txt).
#
# torch comes from the registry: requirements-min.txt's release is a CUDA build (about 5 GB in the venv; it runs on
# CPU), installed first so that nothing else picks a torch. Every step is skipped when the venv already holds it.
#
# Usage: bash scripts/setup_min.sh   (PYTHON=python3.12 picks the interpreter). Standard output is the venv to run the
# tests in, and nothing else (the rest goes to standard error).
set -euo pipefail
exec 3>&1 1>&2
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$(date +%s)
MIN=$(sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
[ -n "$MIN" ] || { echo "setup_min.sh: no 'transformers>=X,' requirement in pyproject.toml" >&2; exit 2; }
VENV=.venv-min
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
pip() { python -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pinned() { sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements-min.txt; }
version_is() { python -c "import importlib.metadata as m, sys; sys.exit(m.version('$1').split('+')[0] != '$2')" 2>/dev/null; }
pip install -q --upgrade pip >/dev/null 2>&1 || true
version_is torch "$(pinned torch)" || pip install -q "torch==$(pinned torch)"
python -c "import transformers, sys; sys.exit(not transformers.__version__.startswith('$MIN.'))" 2>/dev/null \
    || pip install -q "transformers==$MIN.*" "torch==$(pinned torch)"
pip install -q -r requirements-min.txt "pytest==9.2.0" pytest-xdist tqdm matplotlib "gguf==0.19.0" parameterized
pip install -q --no-deps "optimum-quanto==0.2.7" ninja
python -m pip show difftransformer 2>/dev/null | grep -qx "Editable project location: $(pwd -P)" || pip install -q --no-deps -e .
python -c "import torch, transformers, difftransformer; print('ready (lowest supported): torch', torch.__version__, '| transformers', transformers.__version__)"
echo "setup_min.sh: $(( $(date +%s) - start )) s"
echo "$VENV" >&3
