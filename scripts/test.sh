#!/usr/bin/env bash
# The test command (what CI runs): set up (idempotent), then
#   1. the whole suite in .venv (the pinned versions of requirements-dev.txt);
#   2. the core model tests in .venv-min, on the lowest transformers version setup.py declares;
#   3. the serving tests (vLLM, OpenAI-compatible server) in .venv-vllm.
# Extra arguments go to the first pytest run (e.g. `bash scripts/test.sh -k generation`).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
bash scripts/setup.sh
.venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 "$@"

bash scripts/setup_min.sh
.venv-min/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_configuration_difftransformer.py tests/test_modeling_difftransformer.py \
    tests/test_save_load_difftransformer.py tests/test_generation_difftransformer.py tests/test_flash_path.py \
    -k "not flex"

# 3. serving: vLLM (its CPU build) pins its own torch and transformers, so it has its own venv.
bash scripts/setup_vllm.sh
.venv-vllm/bin/python -m pytest tests_serving -q -p no:cacheprovider
