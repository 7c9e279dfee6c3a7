#!/usr/bin/env bash
# Download, here, the wheels scripts/gpu_check.sh installs on the GPU machine, which has no network at all.
#
# The GPU machine has Python 3.12, torch 2.11 (CUDA 13.0), transformers 5.17, huggingface_hub 1.33, safetensors 0.8.0,
# accelerate 1.15, triton 3.6 and no flash-attn. The package needs transformers>=5.19,<6: CI's pin
# (requirements-dev.txt's transformers==X) is carried. Its own requirements (METADATA Requires-Dist; transformers
# checks tokenizers, regex, huggingface-hub, safetensors, accelerate, ... at import) are met there:
# huggingface-hub>=1.31,<3 by 1.33, safetensors>=0.8.0 by 0.8.0, and tokenizers>=0.23.1,<0.24 and regex>=2025.10.22
# are what transformers 5.17 itself requires. The machine's tokenizers and regex versions were never listed, so CI's
# tokenizers 0.23.3 and regex 2026.11.19 come along anyway (4 MB): one missing or stale package would otherwise cost
# the whole GPU run. One version of each, about 16 MB.
#
# Usage: bash scripts/gpu_wheels.sh    (writes .whl/ at the repository root; carry it: run(carry=[".whl"]))
set -euo pipefail
cd "$(dirname "$0")/.."

# liger-kernel: pure Python over the machine's torch and Triton (the GPU check's `liger` checks).
TRANSFORMERS=$(sed -n 's/^transformers==\([0-9.]*\).*/\1/p' requirements-dev.txt)
[ -n "$TRANSFORMERS" ] || { echo "no transformers==X pin in requirements-dev.txt" >&2; exit 1; }
WHEELS=("transformers==$TRANSFORMERS" tokenizers==0.23.3 regex==2026.11.19 liger-kernel==0.8.5)
PYTHON=${PYTHON:-python3}

mkdir -p .whl
# .whl/ is build output, never committed: ignored locally (the device tool carries ignored paths only when named).
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    # keep one version of each: drop other versions of this package left by an earlier run
    find .whl -maxdepth 1 -name "${name}-*.whl" ! -name "${name}-${spec#*==}-*.whl" -delete
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "$spec"
done
ls -l .whl
du -sh .whl
