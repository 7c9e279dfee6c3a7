#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest tests -q -p no:cacheprovider --durations=15 "$@"
