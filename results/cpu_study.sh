#!/usr/bin/env bash
# The CPU study behind results/README.md (config/study_cpu.py: d=64, 4.1M training tokens per run), in parts:
#   compare  all five modes and delta_block variant=official, 12 layers, seeds 0-2             18 runs
#   depth    standard / attnres / delta_block at 4 and 24 layers, seeds 0-2 (12: compare)      18 runs
#   convert  the 12-layer standard model of seed 0, exported and fine-tuned as itself
#            and converted to delta_block (with and without res_gate) and attnres                4 runs
#   length   standard / attnres / delta_block, 12 layers, seed 0, at 0.25M, 1M, 2M tokens          9 runs
#   depth36  standard / attnres / delta_block / delta_attnres at 36 layers (the paper's 1b depth), seeds 0-2
#                                                                                               12 runs
# bash results/cpu_study.sh [PART ...]   (default: all, in this order). JOBS runs at a time, one thread each
# (results/study_runs.sh). A finished run is saved in results/runs and skipped from then on, so the script can be
# stopped and started again, in a later sitting too. Each part's wall time is appended to results/runs/time.txt,
# each run's to OUT_DIR/seconds (and its saved record). The tables: report.py, with the commands in
# results/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/study
source results/study_runs.sh     # run_all
SEEDS="0 1 2"

compare() {
    for seed in $SEEDS; do
        for mode in standard attnres full_attnres delta_attnres delta_block; do
            echo "$OUT/L12/${mode}_s$seed config/study_cpu.py --residual=$mode --seed=$seed"
        done
        echo "$OUT/L12/delta_block_official_s$seed config/study_cpu.py --residual=delta_block --variant=official --seed=$seed"
    done | run_all
}

convert() {
    if [ ! -f $OUT/convert/pretrained/config.json ]; then
        # compare's 12-layer standard model of seed 0, trained again if its folder is gone (on another machine
        # not bit-equal to the saved run; what the part compares all starts from this one export)
        echo "$OUT/L12/standard_s0 config/study_cpu.py --residual=standard --seed=0" | RERUN_SAVED=1 run_all
        python export.py $OUT/L12/standard_s0/ckpt $OUT/convert/pretrained
    fi
    {
        echo "$OUT/convert/standard config/study_cpu_convert.py --residual=standard"
        echo "$OUT/convert/delta_block_gate config/study_cpu_convert.py --residual=delta_block --res_gate=True"
        echo "$OUT/convert/delta_block config/study_cpu_convert.py --residual=delta_block"
        echo "$OUT/convert/attnres config/study_cpu_convert.py --residual=attnres"
    } | run_all
}

length() {   # 4000 steps is the compare part; 250 steps keeps the old study's 25 warmup steps
    for steps in 2000 1000 250; do
        warmup=$(( steps < 1000 ? 25 : 100 )); every=$(( steps < 1000 ? 50 : 250 ))
        for mode in standard attnres delta_block; do
            echo "$OUT/length/S$steps/${mode}_s0 config/study_cpu.py --residual=$mode --seed=0 --max_iters=$steps" \
                 "--lr_decay_iters=$steps --warmup_iters=$warmup --eval_interval=$every"
        done
    done | run_all
}

depth_runs() {
    for L in "$@"; do
        for seed in $SEEDS; do
            for mode in standard attnres delta_block; do
                echo "$OUT/L$L/${mode}_s$seed config/study_cpu.py --residual=$mode --seed=$seed --n_layer=$L"
            done
            if [ $L = 36 ]; then
                echo "$OUT/L$L/delta_attnres_s$seed config/study_cpu.py --residual=delta_attnres --seed=$seed --n_layer=$L"
            fi
        done
    done | run_all
}
depth() { depth_runs 4 24; }
depth36() { depth_runs 36; }

mkdir -p $OUT results/runs
run_parts "" "compare depth convert length depth36" "$@"
