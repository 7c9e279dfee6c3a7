#!/usr/bin/env bash
# The prepared GPU check (docs/performance.md, "The GPU check"): on a machine with one CUDA GPU and no network, install
# the carried wheels, then run `python -m benchmarks.gpu_check`: in this order, speed at Llama-3.2-1B's shape against a
# same-shape Llama (compiled decoding included), one layer's attention by every candidate kernel (with the SDPA backend
# each ran), the Triton tuning sweep, every attention backend's correctness against a float64 reference. About 9
# minutes (GPU_CHECK_BUDGET, 510 s, then the row under way finishes); writes gpu_check.json, gpu_check.txt (tables and
# one line per check) and gpu_check.log into the output folder.
#
# Usage:  bash scripts/gpu_wheels.sh                 # here, once: downloads the wheels into .whl/
#         GIT_COMMIT=<sha> bash scripts/gpu_check.sh [OUT_DIR] [-- gpu_check options, e.g. --only checks]
#
# OUT_DIR: the argument, else $OUT (set by the device tool; what is written there comes back), else
# benchmarks/results/. GIT_COMMIT (and GIT_DIRTY=0/1) name the code where the copy has no .git; else `git rev-parse`;
# the report also holds a digest of the package's sources (`python -m benchmarks.gpu_check --digest` here).
# GPU_CHECK_BUDGET: seconds after which no further row starts (default 510); GPU_CHECK_TIMEOUT: hard limit of the
# Python run (default 540; the report is rewritten after every row, so a cut-short run keeps what it measured).
# GPU_CHECK_WHEELS: the folder of carried wheels (default .whl); GPU_CHECK_SITE: where they are installed (/tmp/site).
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
esac

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT_DIR=${OUT:-$ROOT/benchmarks/results}
if [ $# -gt 0 ] && [ "$1" != "--" ]; then OUT_DIR=$1; shift; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}

main() {
echo "gpu_check.sh: $(date -u +%FT%TZ), output in $OUT_DIR, python $($PY --version 2>&1)"

# 1. The carried wheels (no network there): into $SITE, ahead of the machine's own packages on the path.
shopt -s nullglob
WHEELS_DIR=${GPU_CHECK_WHEELS:-.whl}
wheels=("$WHEELS_DIR"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "WARNING: no wheels in $WHEELS_DIR/ (run scripts/gpu_wheels.sh here and carry .whl):" \
        "using the machine's packages"
else
    echo "installing ${#wheels[@]} wheels into $SITE: ${wheels[*]##*/}"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}"; then
        echo "pip failed: unpacking the wheels instead (a wheel is a zip of the installed files)"
        "$PY" - "$SITE" "${wheels[@]}" <<'EOF'
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
# 2. The package itself from this working tree (never pip-installed: its dependencies are the machine's), and
#    benchmarks/ as a package of the root (`python -m benchmarks.gpu_check`).
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# 3. Which code runs: the caller's GIT_COMMIT, else git's answer (read by gpu_check.py), else "unknown".
if [ -z "${GIT_COMMIT:-}" ] && git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
    GIT_COMMIT=$(git -C "$ROOT" rev-parse HEAD)
    GIT_DIRTY=$([ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ] && echo 1 || echo 0)
fi
export GIT_COMMIT=${GIT_COMMIT:-unknown} GIT_DIRTY=${GIT_DIRTY:-unknown}

# 4. What transformers needs, as importlib sees it after the install: printed, never fatal.
"$PY" - <<'EOF'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
    print("transformers", md.version("transformers"), "from", md.distribution("transformers").locate_file(""))
    for text in md.requires("transformers") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
            ok = req.specifier.contains(have, prereleases=True)
        except md.PackageNotFoundError:
            have, ok = "missing", False
        print(f"  {'ok ' if ok else 'BAD'} {req.name}{req.specifier} -> {have}")
except Exception as exc:  # the check is informative only
    print("could not check transformers' requirements:", exc)
EOF

# 5. The check: a time budget inside, a hard timeout outside; on a timeout the summary is written from the report.
BUDGET=${GPU_CHECK_BUDGET:-510}
timeout --kill-after=10 "${GPU_CHECK_TIMEOUT:-540}" \
    "$PY" -m benchmarks.gpu_check --out "$OUT_DIR" --budget "$BUDGET" "$@"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "benchmarks.gpu_check ran past its timeout (rc $rc): writing the summary of what the report holds"
    "$PY" -m benchmarks.gpu_check --out "$OUT_DIR" --summarize
fi
rm -f "$OUT_DIR/gpu_check.json.tmp"
echo "gpu_check.sh: done, rc $rc (0: every check passed or was skipped; 1: a check failed or raised)"
return $rc
}

main "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"   # everything also lands in the log
exit "${PIPESTATUS[0]}"
