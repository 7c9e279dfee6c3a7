#!/usr/bin/env bash
# The test command (what CI runs): set up (idempotent), then
#   1. the whole suite in .venv (the pinned versions of requirements-dev.txt), on two pytest-xdist workers;
#   2. the core model tests on the lowest transformers version setup.py declares (in .venv-vllm, whose vLLM build pins
#      that version; scripts/setup_min.sh builds .venv-min where the two part);
#   3. the serving tests (vLLM, OpenAI-compatible server) in .venv-vllm.
# Extra arguments go to the first pytest run (e.g. `bash scripts/test.sh -k generation`).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# .venv and .venv-vllm are set up side by side (pip keeps one core busy each); .venv-vllm's output follows the first
# run's.
setup_log=$(mktemp)
bash scripts/setup_vllm.sh >"$setup_log" 2>&1 &
setup_pid=$!
trap 'kill "$setup_pid" 2>/dev/null || true; rm -f "$setup_log"' EXIT
bash scripts/setup.sh
# Two workers (pytest-xdist), each test file whole on one worker: module fixtures are built once.
.venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 -n 2 --dist loadfile "$@"
wait "$setup_pid" || { cat "$setup_log"; echo "setting up .venv-vllm failed" >&2; exit 1; }
cat "$setup_log"

min_venv=$(bash scripts/setup_min.sh .venv-vllm)
"$min_venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_configuration_difftransformer.py tests/test_modeling_difftransformer.py \
    tests/test_save_load_difftransformer.py tests/test_generation_difftransformer.py tests/test_flash_path.py \
    -k "not flex"

# 3. serving: vLLM (its CPU build) pins its own torch and transformers, so it has its own venv.
.venv-vllm/bin/python -m pytest tests_serving -q -p no:cacheprovider
