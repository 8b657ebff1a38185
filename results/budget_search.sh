#!/usr/bin/env bash
# The token budget of the CPU study (issue 17): the smallest number of training tokens at which `standard` improves
# monotonically from 4 to 12 to 24 layers at the study's width (d=64). Same demo corpus, held-out split and recipe as
# config/study_cpu.py (100 warmup steps, evaluation every 250 steps on 32 x 16 x 64 held-out tokens).
# A first search (one seed, 1M / 2M / 4M tokens, results/study_budget) chose 2M, where 3 seeds then showed no gain
# from 12 to 24 layers (results/study_2m/depth). This checks 4M tokens (4000 steps of 16 x 64) with 3 seeds: 9 runs,
# about 4 hours of one core: monotone, seed by seed, so 4M became the study's budget (config/study_cpu.py), and
# these runs are also its standard runs at 4, 12 and 24 layers (the same settings: they were copied into
# out/study/L*/standard_s*). JOBS runs in parallel, one thread each; a finished run is skipped, a stopped one
# continues. Then:
#   python report.py out/study/budget/S4000/* --out=results/study_budget_4m
# (results/study_budget came from the one-seed version of this script, in commit 1528d7c.)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/study/budget
source results/study_runs.sh     # run_all
for seed in 0 1 2; do
    for L in 4 12 24; do
        echo "$OUT/S4000/standard_L${L}_s$seed config/study_cpu.py --residual=standard --seed=$seed --n_layer=$L" \
             "--max_iters=4000 --lr_decay_iters=4000"
    done
done | run_all
