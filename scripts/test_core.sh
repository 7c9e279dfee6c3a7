#!/usr/bin/env bash
# The quick test command: the core suite, in whatever Python environment is active (the one README's Install made),
# in a few minutes on two cores: the model against its float64 reference, generation and every cache, save/load,
# remote-code folders, the Llama conversion, PEFT, pipeline, Trainer, Motif-2 folders, and the installed
# transformers' API the package relies on. It leaves out what costs minutes and the whole suite covers (CORE_K):
# flex_attention's compiled kernels, bf16 (the same code paths as float32) and the released Motif-2 layer shapes.
#
#   pip install -e ".[test]"        # once: pytest and the test extras (pytest alone runs it too, skipping a few tests)
#   bash scripts/test_core.sh       # extra arguments go to pytest, e.g. -x, or -n 2 (where pytest-xdist is installed)
#
# PYTHON=path/to/python picks another interpreter. scripts/test.sh (CI) runs the same CORE list on the newest and the
# lowest releases the package declares, and the whole suite on the pinned ones (CONTRIBUTING.md).
CORE=(tests/models/test_upstream_api.py tests/models/test_modeling_difftransformer.py
      tests/models/test_save_load_difftransformer.py tests/models/test_generation_difftransformer.py
      tests/models/test_continuous_batching.py tests/models/test_remote_code_folders.py
      tests/convert/test_convert_llama.py tests/integrations/test_peft.py tests/integrations/test_pipeline.py
      tests/integrations/test_trainer.py tests/models/test_motif.py tests/models/test_registration.py)
CORE_K="not flex and not bfloat16 and not released_layer_shapes"
# Sourced (scripts/test.sh): the list above and nothing else.
(return 0 2>/dev/null) && return 0

set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3 || echo python)}
"$PY" -c "import pytest" 2>/dev/null || {
    echo "test_core.sh: pytest is not installed for $(command -v "$PY" || echo "$PY"): pip install -e \".[test]\"" >&2
    exit 2
}
"$PY" -c "import torch, transformers, difftransformer" 2>/dev/null || {
    echo "test_core.sh: torch, transformers or difftransformer does not import for $PY: activate the environment" \
         "README's Install made (. .venv/bin/activate), or follow Install" >&2
    exit 2
}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m pytest -q -p no:cacheprovider -rs "${CORE[@]}" -k "$CORE_K" "$@"
