#!/usr/bin/env bash
# The CPU study behind results/README.md, exactly as it was run: every residual mode x 3 seeds at 8
# layers, the conversion of a pretrained 'standard' model, and a depth contrast (4 and 12 layers).
# About an hour on 2 cores (JOBS runs in parallel, one thread each). A finished run is skipped, so
# the script can be interrupted and started again. Then: python report.py ... (see results/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/study
source results/study_runs.sh     # run_all

# 1. every mode (and Delta Block as the authors' code runs it) x 3 seeds, 8 layers
for seed in 0 1 2; do
    for mode in standard attnres full_attnres delta_attnres delta_block; do
        echo "$OUT/L8/${mode}_s$seed config/study_cpu.py --residual=$mode --seed=$seed"
    done
    echo "$OUT/L8/delta_block_official_s$seed config/study_cpu.py --residual=delta_block --variant=official --seed=$seed"
done | run_all

# 2. conversion: export the standard model of seed 0, fine-tune it as itself and converted
[ -f $OUT/convert/pretrained/config.json ] || python export.py $OUT/L8/standard_s0/ckpt $OUT/convert/pretrained
{
    echo "$OUT/convert/standard config/study_cpu_convert.py --residual=standard"
    echo "$OUT/convert/delta_block_gate config/study_cpu_convert.py --residual=delta_block --res_gate=True"
    echo "$OUT/convert/delta_block config/study_cpu_convert.py --residual=delta_block"
    echo "$OUT/convert/attnres config/study_cpu_convert.py --residual=attnres"
} | run_all

# 3. depth contrast: the same recipe at 4 and 12 layers (8 is step 1), n_blocks 4 throughout
for L in 4 12; do
    for seed in 0 1 2; do
        for mode in standard attnres delta_block; do
            echo "$OUT/L$L/${mode}_s$seed config/study_cpu.py --residual=$mode --seed=$seed --n_layer=$L"
        done
    done
done | run_all
