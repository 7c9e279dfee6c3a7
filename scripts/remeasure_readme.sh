#!/usr/bin/env bash
# Re-measure the CPU runs at the Llama-style shape (the README's CPU row, docs/reports/2026-11-26-cpu-speed.md) on the
# current code, then rewrite every table the docs build from them.
#
#   bash scripts/remeasure_readme.sh            # estimated 20-25 minutes on 2 idle cores; measured: fp32 took 67
#                                               # minutes on a shared AVX2 machine, where bf16 (no bf16 instructions)
#                                               # reached 21 % in 20 minutes and was stopped
#
# The runs are benchmarks/bench.py at the Llama-style shape (hidden 512, 8 layers, 8 query / 4 KV heads of
# width 64, vocabulary 32000; random weights): Llama, DiffLlama, ours V1 and ours V2, one thread, CPU-time clock,
# 5 interleaved repetitions after one warm-up, rows prefill 1x512 / 1x2048 / 8x256, decode batch 1 and 8 with a
# dynamic cache and with a compiled static cache (128 new tokens after 128), a training step 4x512 with and without
# gradient checkpointing, and peak memory. fp32 and bf16 run side by side, one process per core (each times its own
# CPU seconds). The estimate: the committed fp32 and bf16 runs (with ours_v1_padded as a fifth model and the
# uncompiled static-cache rows) hold about 24 and 19 CPU-minutes of timed work and warm-up; without those, about 15
# and 12, plus compiling (compiled decode: 4 models x 2 batch sizes) and the memory rows, a few minutes each.
#
#   REMEASURE_SMOKE=1 bash scripts/remeasure_readme.sh   # the same commands at --smoke sizes into a temporary folder,
#                                                        # no compiled decode, docs untouched (tests/repository/test_doc_numbers.py)
#
# It writes benchmarks/results/bench_t1cpu_{fp32,bf16}.json and .png (the JSONs record commit, command, machine and
# versions and the code the run executed), then runs `python scripts/doc_tables.py --write`, which rewrites every table
# block of the README and docs/ from its JSON, and `python scripts/doc_tables.py`, which checks them (what
# tests/repository/test_doc_numbers.py checks). Read the report's prose against the new tables, then commit the JSONs, PNGs and
# docs together (a new date: a new report under docs/reports/).
#
# Run it on a quiet machine with the code committed: the JSONs name the commit, and uncommitted changes are listed in
# every table that quotes the result.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=benchmarks/results
groups=prefill,decode,decode_compiled,train,train_ckpt,memory
smoke=()
if [ -n "${REMEASURE_SMOKE:-}" ]; then
    OUT=$(mktemp -d)
    groups=prefill,decode,train,train_ckpt,memory
    smoke=(--smoke)
fi

if ! git diff --quiet HEAD -- difftransformer benchmarks; then
    echo "the code differs from HEAD (git diff HEAD -- difftransformer benchmarks): commit it first" >&2
    [ -n "${REMEASURE_SMOKE:-}" ] || exit 2
fi

common=(--models llama,diffllama,ours_v1,ours_v2 --only $groups --threads 1 --clock cpu --reps 5 --warmup 1 "${smoke[@]}")
start=$(date +%s)
"$PY" benchmarks/bench.py --dtype fp32 "${common[@]}" --json $OUT/bench_t1cpu_fp32.json --png $OUT/bench_t1cpu_fp32.png \
    > /tmp/remeasure_fp32.log 2>&1 &
fp32=$!
"$PY" benchmarks/bench.py --dtype bf16 "${common[@]}" --json $OUT/bench_t1cpu_bf16.json --png $OUT/bench_t1cpu_bf16.png \
    > /tmp/remeasure_bf16.log 2>&1 &
bf16=$!
status=0
wait $fp32 || { echo "fp32 run failed: /tmp/remeasure_fp32.log" >&2; status=1; }
wait $bf16 || { echo "bf16 run failed: /tmp/remeasure_bf16.log" >&2; status=1; }
echo "measured in $(( ($(date +%s) - start) / 60 )) minutes"
[ $status -eq 0 ] || exit $status
grep -h -A20 "^\*\*" /tmp/remeasure_fp32.log /tmp/remeasure_bf16.log || true
if [ -n "${REMEASURE_SMOKE:-}" ]; then
    ls "$OUT"
    exit 0
fi

"$PY" scripts/doc_tables.py --write
"$PY" scripts/doc_tables.py
