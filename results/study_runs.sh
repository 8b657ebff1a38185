# Sourced by the CPU studies' scripts (study_v2.sh; study v1's cpu_study.sh): the demo corpus, and run_all, which reads
# lines "OUT_DIR SETTINGS..." and runs each as one train.py run (JOBS at a time, one thread each), its console
# output in OUT_DIR/train.txt. A finished run is saved as results/runs/<parent>/<run>.json (report.py --save_runs:
# settings, log, measured routing, no weights), from which the committed tables are made, so the results outlive
# the run folders and a study can go on in a later sitting. A saved run is skipped (RERUN_SAVED=1 trains it again),
# a stopped one continues from its last checkpoint (--init_from=resume where OUT_DIR has one; otherwise the run starts
# as its settings say: from scratch, or from a pretrained model in the conversion part): a script can be stopped and
# restarted.
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=1
[ -f data/demo/meta.json ] || python prepare_fineweb.py --demo

train_one() {
    local dir=$1; shift
    [ -f "results/runs/$(basename "$(dirname "$dir")")/$(basename "$dir").json" ] && [ "${RERUN_SAVED:-0}" = 0 ] && return 0
    mkdir -p "$dir"
    if [ ! -f "$dir/done" ]; then
        # the run's wall time (one thread), summed over its invocations: OUT_DIR/seconds. OUT_DIR/started marks an
        # invocation under way; one killed together with this shell (a sitting's end) is counted when the run goes
        # on, up to its log's last write (at most a log interval short)
        local status=0 last
        if [ -f "$dir/started" ]; then
            last=$(stat -c %Y "$dir/log.jsonl" 2>/dev/null || echo 0)
            add_seconds "$dir" $(( last > $(cat "$dir/started") ? last - $(cat "$dir/started") : 0 ))
        fi
        date +%s > "$dir/started"
        local resume=(); [ -e "$dir/ckpt" ] && resume=(--init_from=resume)
        python train.py "$@" --out_dir="$dir" "${resume[@]}" >> "$dir/train.txt" 2>&1 || status=$?
        add_seconds "$dir" $(( $(date +%s) - $(cat "$dir/started") )) && rm "$dir/started"
        [ $status = 0 ] || return $status
        touch "$dir/done"
    fi
    python report.py "$dir" --save_runs=results/runs >> "$dir/train.txt" 2>&1
}
add_seconds() { echo $(( $(cat "$1/seconds" 2>/dev/null || echo 0) + $2 )) > "$1/seconds"; }
export -f train_one add_seconds
run_all() { xargs -P "$JOBS" -L 1 bash -c 'train_one "$@"' _; }

# The named parts (functions of the calling script), in order, or the default ones; each part's wall time is
# appended to results/runs/time.txt with the commit that ran it. run_parts LABEL "DEFAULT PARTS" [PART ...]
run_parts() {
    local label=$1 defaults=$2 p start; shift 2
    for p in ${@:-$defaults}; do
        start=$(date +%s)
        $p
        echo "$label$p $(date -u +%FT%TZ) $(( $(date +%s) - start )) s wall, JOBS=$JOBS, $(git rev-parse --short HEAD)" >> results/runs/time.txt
    done
}
