#!/usr/bin/env bash
# The main job: set up (idempotent), then train a small DiffTransformer on the embedded Python-stdlib corpus.
# Extra arguments go to examples/train.py (see `bash scripts/demo.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python examples/train.py "$@"
