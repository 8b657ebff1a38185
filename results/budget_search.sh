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
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=1
[ -f data/demo/meta.json ] || python prepare_fineweb.py --demo

train_one() {   # OUT_DIR SETTINGS...: one train.py run, its console output in OUT_DIR/train.txt
    local dir=$1; shift
    [ -f "$dir/done" ] && return 0
    rm -rf "$dir" && mkdir -p "$dir"
    python train.py "$@" --out_dir="$dir" > "$dir/train.txt" 2>&1 && touch "$dir/done"
}
export -f train_one
for steps in 1000 2000 4000; do
    for L in 24 12 4; do
        echo "$OUT/S$steps/standard_L$L config/study_cpu.py --residual=standard --seed=0 --n_layer=$L --max_iters=$steps" \
             "--lr_decay_iters=$steps --warmup_iters=100 --eval_interval=250 --eval_iters=32"
    done
done | xargs -P "$JOBS" -L 1 bash -c 'train_one "$@"' _
