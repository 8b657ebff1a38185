#!/usr/bin/env bash
# The token budget of the CPU study (issue 17): the smallest number of training tokens at which `standard` improves
# monotonically from 4 to 12 to 24 layers at the study's width (d=64), one seed, 1M / 2M / 4M tokens (1000 / 2000 /
# 4000 steps of 16 x 64 tokens). Same demo corpus, held-out split and recipe as config/study_cpu.py; 100 warmup
# steps, evaluation every 250 steps on 32 x 16 x 64 held-out tokens. About 100 minutes of one core in all;
# JOBS runs in parallel, one thread each. A finished run is skipped. Then:
#   python report.py out/study/budget/S*/* --routing=log --out=results/study_budget
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/study/budget
source results/study_runs.sh     # run_all
for steps in 1000 2000 4000; do
    for L in 24 12 4; do
        echo "$OUT/S$steps/standard_L$L config/study_cpu.py --residual=standard --seed=0 --n_layer=$L --max_iters=$steps" \
             "--lr_decay_iters=$steps --warmup_iters=100 --eval_interval=250 --eval_iters=32"
    done
done | run_all
