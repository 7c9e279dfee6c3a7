#!/usr/bin/env bash
# Creates .venv-min (if missing): the lowest transformers version setup.py declares, for the core tests that prove the
# declared range true (scripts/test.sh runs them). Only what those tests need is installed; the version comes from
# setup.py's `transformers>=X` requirement, so the range and this check cannot drift apart.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MIN=$(sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' setup.py)
[ -n "$MIN" ] || { echo "setup_min.sh: no 'transformers>=X,' requirement in setup.py" >&2; exit 2; }
[ -x .venv-min/bin/python ] || "$PY" -m venv .venv-min
. .venv-min/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
python -m pip install -q "transformers==$MIN.*" "accelerate==1.15.0" "safetensors==0.8.0" "tokenizers" "pytest==9.2.0" tqdm
python -m pip install -q --no-deps -e .
python -c "import torch, transformers, difftransformer; print('ready (lowest supported): torch', torch.__version__, '| transformers', transformers.__version__)"
