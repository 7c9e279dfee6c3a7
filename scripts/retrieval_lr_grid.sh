#!/usr/bin/env bash
# The learning-rate grid of the retrieval study (docs/analysis.md, "Retrieval with distractors and low-bit
# attention"): the three models at each learning rate on the lr_grid preset's seeds (20,000 steps at most; a run stops
# once it reaches 90% on both tasks and holds it), in WORKERS single-threaded processes. One folder per (learning rate,
# seed): benchmarks/results/retrieval_lr_grid/lr<rate>_seed<seed>/results.json. Resumable: a rerun skips every finished
# (model, seed) run. Seeds come first, so that an interrupted grid has whole seeds.
#   bash scripts/retrieval_lr_grid.sh            # LRS="5e-4 1e-3 2e-3" SEEDS="5 6 7 8" WORKERS=2 MODELS=llama,v1,v2
# The bracket of docs/reports/2026-12-02-retrieval-bracket-and-fixed-budget.md: LRS="4e-3 8e-3" MODELS=llama,v2.
# PRESET picks another preset of benchmarks/retrieval_lowbit.py (default lr_grid; OUT then names its own folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LRS=${LRS:-5e-4 1e-3 2e-3}
SEEDS=${SEEDS:-5 6 7 8}
WORKERS=${WORKERS:-2}
MODELS=${MODELS:-llama,v1,v2}
PRESET=${PRESET:-lr_grid}
OUT=${OUT:-benchmarks/results/retrieval_lr_grid}
jobs=()
for seed in $SEEDS; do
    for lr in $LRS; do
        jobs+=("$seed $lr")
    done
done
worker() {  # runs jobs k, k + WORKERS, ...
    local k=$1
    for ((i = k; i < ${#jobs[@]}; i += WORKERS)); do
        read -r seed lr <<<"${jobs[$i]}"
        "$PY" -m benchmarks.retrieval_lowbit --preset "$PRESET" --models "$MODELS" --lr "$lr" --seeds "$seed" \
            --no-plots \
            --out "$OUT/lr${lr}_seed${seed}"
    done
}
mkdir -p "$OUT"
pids=()
for ((k = 0; k < WORKERS; k++)); do
    worker "$k" >"$OUT/worker$k.log" 2>&1 &  # not committed (.gitignore)
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
