#!/usr/bin/env bash
# The venv for the core tests on the lowest transformers version setup.py declares (they prove the declared range
# true; scripts/test.sh runs them). The version comes from setup.py's `transformers>=X` requirement, so the range and
# this check cannot drift apart.
#
# Usage: bash scripts/setup_min.sh [VENV]
#   If VENV (scripts/test.sh passes .venv-vllm, whose vLLM CPU build pins transformers) already holds that version,
#   nothing is installed; otherwise .venv-min is created (if missing) with only what those tests need. Standard output
#   is the venv to run them in, and nothing else (the rest goes to standard error).
set -euo pipefail
exec 3>&1 1>&2
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MIN=$(sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
[ -n "$MIN" ] || { echo "setup_min.sh: no 'transformers>=X,' requirement in pyproject.toml" >&2; exit 2; }
has_lowest() { "$1/bin/python" -c "import sys, transformers; sys.exit(not transformers.__version__.startswith('$MIN.'))" 2>/dev/null; }
if [ -n "${1:-}" ] && has_lowest "$1"; then
    echo "ready (lowest supported): transformers $MIN.x is in $1"
    echo "$1" >&3
    exit 0
fi
[ -x .venv-min/bin/python ] || "$PY" -m venv .venv-min
. .venv-min/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
python -m pip install -q "transformers==$MIN.*" "accelerate==1.15.0" "safetensors==0.8.0" "tokenizers" "pytest==9.2.0" \
    pytest-xdist tqdm matplotlib ninja
python -m pip install -q --no-deps "peft==0.21.2" "optimum-quanto==0.2.7"
python -m pip install -q --no-deps -e .
python -c "import torch, transformers, difftransformer; print('ready (lowest supported): torch', torch.__version__, '| transformers', transformers.__version__)"
echo .venv-min >&3
