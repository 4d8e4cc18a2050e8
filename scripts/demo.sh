#!/usr/bin/env bash
# The main demo: data-parallel torch training on 4 ranks + 1 spare loses logical rank 1 after step 73
# (the spare takes over) and logical rank 2 after step 142 (no spare left: the job shrinks to 3 ranks).
# A failure-free run of the same job comes first; the report prints the recovery timeline and the
# ETTR of both, and plots the two loss curves.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-elastic-run/demo}
steps=${DEMO_STEPS:-200}
python -m elastic.launch -n 4 --timeout 300 --run-dir "$out/no-failure" -- python examples/train.py --steps "$steps"
python -m elastic.launch -n 4 --spares 1 --rebuild spare,shrink --inject 1@73,2@142/g1 --timeout 300 \
    --run-dir "$out/two-failures" -- python examples/train.py --steps "$steps"
python -m elastic.report "$out/two-failures" --baseline "$out/no-failure" --plot "$out/loss.png"
