#!/usr/bin/env bash
# Study v3 (results/README.md, "Study v3: the design and the decision rule", committed before these runs).
# config/study_v2.py's shape: 12 layers x d=64, sequences of 256 bytes, 4 per step, 4000 steps = 4.1M training
# tokens, fp32, compiled. Three arms: standard, delta_attnres, full_attnres. The parts, in order:
#   grid      each arm at peak lr 1.5e-3, 3e-3 and 6e-3 on the tuning seeds 100-102; the pick is the lowest mean
#             over the three (report.py --grid --out=results/study_v3/grid writes best_lr.txt)          27 runs
#   pilot     the three arms at their picks, seeds 200-204: the paired SD of each contrast, from which
#             results/study_v3/n_seeds.txt (the number of verdict seeds N) is fixed and committed       15 runs
#   verdict   the three arms at their picks, seeds 0 to N-1, seed by seed (a seed's three runs in one
#             sitting, on one CPU type)                                                              3N runs
# A grid whose best is at an edge (report.py --grid marks it) is extended by the next factor of 2 on all three tuning
# seeds: EXTEND="mode:lr ..." adds those runs to the grid part.
# The tables, from the saved runs (report.py):
#   grid      python report.py results/runs/v3_grid/*.json --grid --unit=byte --no-figures --out=results/study_v3/grid
#   pilot     python report.py results/runs/v3_pilot/*.json --claims=delta_attnres-standard,delta_attnres-full_attnres \
#                 --unit=byte --effect=0.008 --out=results/study_v3/pilot        (its Power line: the SD that fixes N)
#   verdict   python report.py results/runs/v3_verdict/*.json --claims=delta_attnres-standard,delta_attnres-full_attnres \
#                 --margin=0.008 --unit=byte --effect=0.008 --out=results/study_v3/verdict
# [SEEDS=...] bash results/study_v3.sh [PART ...]; JOBS runs at a time, one thread each (results/study_runs.sh). A
# finished run is saved in results/runs/v3_<part>/ and skipped from then on, so the script can be stopped and started
# again. Verdict runs must come from a clean commit (train.py records the dirty files; report.py names them).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/study_v3
source results/study_runs.sh     # run_all, train_one, run_parts
ARMS="standard delta_attnres full_attnres"
TUNING_SEEDS="100 101 102"
PILOT_SEEDS="200 201 202 203 204"

run() {   # out_dir mode lr settings...: one line for run_all (min_lr: a tenth of the peak)
    local dir=$1 mode=$2 lr=$3; shift 3
    echo "$dir config/study_v2.py --residual=$mode --learning_rate=$lr --min_lr=$(python -c "print($lr / 10)") $*"
}

best_lr() {   # an arm's picked lr: results/study_v3/grid/best_lr.txt, lines "mode lr" (report.py --grid)
    local file=results/study_v3/grid/best_lr.txt lr
    [ -f "$file" ] || { echo "no $file: run the grid part and report.py --grid --out=results/study_v3/grid first" >&2; exit 1; }
    lr=$(awk -v m="$1" '$1 == m {print $2}' "$file")
    [ -n "$lr" ] || { echo "$file has no rate for $1 (its grid is incomplete or at an edge)" >&2; exit 1; }
    echo "$lr"
}

grid() {
    {
        for seed in $TUNING_SEEDS; do   # seed by seed: a sitting that ends early leaves whole seeds, every rate alike
            for mode in $ARMS; do
                for lr in 1.5e-3 3e-3 6e-3; do run $OUT/v3_grid/${mode}_lr${lr}_s$seed $mode $lr --seed=$seed; done
            done
            for extra in ${EXTEND:-}; do     # mode:lr, where a mode's best is at an edge of the grid
                run $OUT/v3_grid/${extra%%:*}_lr${extra#*:}_s$seed ${extra%%:*} ${extra#*:} --seed=$seed
            done
        done
    } | run_all
}

paired() {   # part seeds...: the three arms at their picks, seed by seed
    local part=$1; shift
    for mode in $ARMS; do best_lr $mode > /dev/null; done   # stop here, not inside $(...) below
    for seed in "$@"; do
        for mode in $ARMS; do run $OUT/v3_$part/${mode}_s$seed $mode "$(best_lr $mode)" --seed=$seed; done
    done | run_all
}

pilot() { paired pilot $PILOT_SEEDS; }

verdict() {
    local file=results/study_v3/n_seeds.txt
    [ -f "$file" ] || { echo "no $file: run the pilot and commit N (results/README.md, 'Pilot, then N') first" >&2; exit 1; }
    [ -z "$(git status --porcelain --untracked-files=no -- . ':(exclude)results')" ] ||
        { echo "the work tree has changes: verdict runs come from a clean commit (git status)" >&2; exit 1; }
    paired verdict ${SEEDS:-$(seq 0 $(( $(head -1 "$file") - 1 )))}
}

mkdir -p $OUT results/runs
run_parts "v3 " "grid" "$@"
