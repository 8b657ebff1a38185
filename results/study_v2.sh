#!/usr/bin/env bash
# Study v2 (results/README.md, "Study v2": the design and the decision rule, committed before these runs).
# config/study_v2.py: d=64, sequences of 256 bytes, 4 per step, 4000 steps = 4.1M training tokens, compiled.
# The parts, in order (each mode's learning rate: from the grid of its depth and width, results/study_v2/grid*/best_lr.txt):
#   grid12     the 2x2 and standard at 12 layers, lr 1.5e-3, 3e-3, 6e-3, grid seed 100                15 runs
#   L12        the 2x2, standard and delta_block variant=official at 12 layers, seeds 0-4            30 runs
#   L4         standard at 4 layers, seeds 0-4 (does depth help standard at this shape?)             5 runs
#   grid24     every mode at 24 layers at its 12-layer lr and half of it, grid seed 100, and more   16 runs
#   L24        the 2x2 and standard at 24 layers, seeds 0-4                                          25 runs
#   L12x       L12's standard, seeds 0-4, again on this machine's CPU type (amd or intel), where L24's
#              standard ran on a type L12's did not: the depth claim pairs runs of one type             5 runs
#   L24lr      standard at 24 layers at 3e-3, its grid row's other rate, seeds 0-4: a check added after L24's
#              verdict runs (not in the design, no verdict): does standard's rate, picked on one seed, make the
#              24-layer leads?                                                                          5 runs
#   gridw      width 96 (6 heads of 16, 3 KV heads, SwiGLU 288) at 12 layers: 12-layer lr and half   10 runs
#   W96        the 2x2 and standard at width 96, seeds 0-4                                           25 runs
#              (the design's width 128, capped to 96 by its compute rule: results/README.md, "Compute"),
#              and in each seed's block L24lr's check, stated before any W96 result: standard at 1.5e-3,
#              its grid row's runner-up (no verdict; saved in results/runs/v2_W96_std1.5e-3/)         5 runs
#   convert    L12's standard model of seed 0 fine-tuned 120 steps as itself and converted: attnres and
#              full_attnres with zero and with random queries, delta_block (gate or not), seeds 10-12  24 runs
# A grid whose best lr is at an edge (report.py --grid marks it) is extended by the next factor of 2, as many times as
# that takes: EXTEND_12="standard:0.012 delta_block:0.012" and EXTEND_grid24="standard:0.012 full_attnres:0.00075
# attnres:0.00075 delta_attnres:0.006 delta_attnres:0.012 delta_block:0.0015" and EXTEND_gridw="standard:0.0015
# full_attnres:0.006 attnres:0.00075 delta_attnres:0.00075 delta_block:0.0015" (what the three grids needed) add
# those runs to their part.
# [SEEDS=...] bash results/study_v2.sh [PART ...]; JOBS runs at a time, one thread each (results/study_runs.sh). A
# finished run is saved in results/runs/v2_<part>/ and skipped from then on, so the script can be stopped and started
# again.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/study_v2
source results/study_runs.sh     # run_all, train_one
MODES="standard full_attnres attnres delta_attnres delta_block"
SEEDS=${SEEDS:-0 1 2 3 4}   # SEEDS="1 2": only those seeds' blocks, where a sitting has time for no more
GRID_SEED=100

run() {   # out_dir mode lr settings...: one line for run_all (min_lr: a tenth of the peak)
    local dir=$1 mode=$2 lr=$3; shift 3
    echo "$dir config/study_v2.py --residual=$mode --learning_rate=$lr --min_lr=$(python -c "print($lr / 10)") $*"
}

best_lr() {   # the chosen lr of a mode: results/study_v2/grid<12|24|w>/best_lr.txt, lines "mode lr" (report.py --grid)
    local file=results/study_v2/grid$1/best_lr.txt
    [ -f "$file" ] || { echo "no $file: run the grid part and report.py --grid --out=results/study_v2/grid$1 first" >&2; exit 1; }
    awk -v m="$2" '$1 == m {print $2}' "$file"
}

grid12() {
    {
        for mode in $MODES; do
            for lr in 1.5e-3 3e-3 6e-3; do
                run $OUT/v2_grid12/${mode}_lr${lr}_s$GRID_SEED $mode $lr --seed=$GRID_SEED
            done
        done
        for extra in ${EXTEND_12:-}; do     # mode:lr, where a mode's best is at an edge of the grid
            run $OUT/v2_grid12/${extra%%:*}_lr${extra#*:}_s$GRID_SEED ${extra%%:*} ${extra#*:} --seed=$GRID_SEED
        done
    } | run_all
}

verdict() {   # part grid settings...: the 2x2 and standard, seeds 0-4, each at its lr of the grid; seed by seed (the
    local part=$1 grid=$2; shift 2   # five modes of seed 0, then of seed 1...): each seed's paired block on one machine
    best_lr $grid standard > /dev/null   # no grid table: stop here (inside $(...) below, exit would end only that)
    {                                # (results/README.md, "Across sittings"; L12 ran mode by mode, on one machine)
        for seed in $SEEDS; do
            for mode in $MODES; do
                run $OUT/v2_$part/${mode}_s$seed $mode "$(best_lr $grid $mode)" --seed=$seed "$@"
            done
            if [ "$part" = W96 ]; then   # the check of standard's width-96 rate (no verdict), in its seed's block
                run $OUT/v2_W96_std1.5e-3/standard_s$seed standard 1.5e-3 --seed=$seed "$@"
            fi
        done
        if [ "$part" = L12 ]; then
            for seed in $SEEDS; do
                run $OUT/v2_$part/delta_block_official_s$seed delta_block "$(best_lr $grid delta_block)" --variant=official --seed=$seed
            done
        fi
    } | run_all
}

halves() {   # part settings...: every mode at its 12-layer lr and half of it, grid seed, and EXTEND_<part>'s runs
    local part=$1 extend=EXTEND_$1; shift
    best_lr 12 standard > /dev/null
    {
        for mode in $MODES; do
            local lr; lr=$(best_lr 12 $mode)
            for x in $lr $(python -c "print($lr / 2)"); do
                run $OUT/v2_$part/${mode}_lr${x}_s$GRID_SEED $mode $x --seed=$GRID_SEED "$@"
            done
        done
        for extra in ${!extend:-}; do      # mode:lr, where a mode's best is at an edge of its grid
            run $OUT/v2_$part/${extra%%:*}_lr${extra#*:}_s$GRID_SEED ${extra%%:*} ${extra#*:} --seed=$GRID_SEED "$@"
        done
    } | run_all
}

convert() {   # the 12-layer standard model of seed 0, exported, fine-tuned as itself and converted (3 seeds each)
    if [ ! -f $OUT/convert/pretrained/config.json ]; then
        [ -f $OUT/v2_L12/standard_s0/ckpt/state.json ] ||   # its folder is gone: trained again (bit-equal on one CPU type)
            run $OUT/v2_L12/standard_s0 standard "$(best_lr 12 standard)" --seed=0 | RERUN_SAVED=1 run_all
        python export.py $OUT/v2_L12/standard_s0/ckpt $OUT/convert/pretrained
    fi
    local c=config/study_v2_convert.py std=0.08   # 0.08 x sqrt(64) = 0.02 x sqrt(1024): Qwen3-0.6B's query logit scale
    for seed in 10 11 12; do
        echo "$OUT/v2_convert/standard_s$seed $c --residual=standard --seed=$seed"
        for mode in attnres full_attnres; do
            echo "$OUT/v2_convert/${mode}_s$seed $c --residual=$mode --seed=$seed"
            echo "$OUT/v2_convert/${mode}_std${std}_s$seed $c --residual=$mode --routing_init_std=$std --seed=$seed"
        done
        echo "$OUT/v2_convert/attnres_std0.02_s$seed $c --residual=attnres --routing_init_std=0.02 --seed=$seed"
        echo "$OUT/v2_convert/delta_block_std${std}_s$seed $c --residual=delta_block --routing_init_std=$std --seed=$seed"
        echo "$OUT/v2_convert/delta_block_gate_std${std}_s$seed $c --residual=delta_block --res_gate=True --routing_init_std=$std --seed=$seed"
    done | run_all
}

WIDE="--n_embd=96 --n_head=6 --n_kv_head=3 --intermediate_size=288"
L12() { verdict L12 12; }
L12x() {   # L12's standard runs again on this CPU type, for the depth claim's pairs (results/README.md, "Across sittings")
    local cpu; cpu=$(grep -m1 -o 'AMD\|Intel' /proc/cpuinfo | tr A-Z a-z)
    for seed in $SEEDS; do run $OUT/v2_L12_$cpu/standard_s$seed standard "$(best_lr 12 standard)" --seed=$seed; done | run_all
}
L4() { for seed in $SEEDS; do run $OUT/v2_L4/standard_s$seed standard "$(best_lr 12 standard)" --seed=$seed --n_layer=4; done | run_all; }
grid24() { halves grid24 --n_layer=24; }
L24() { verdict L24 24 --n_layer=24; }
L24lr() { for seed in $SEEDS; do run $OUT/v2_L24_std3e-3/standard_s$seed standard 3e-3 --seed=$seed --n_layer=24; done | run_all; }
gridw() { halves gridw $WIDE; }
W96() { verdict W96 w $WIDE; }

mkdir -p $OUT results/runs
run_parts "v2 " "grid12 L12 L4 convert grid24 L24 gridw W96" "$@"
