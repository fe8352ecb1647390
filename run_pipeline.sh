#!/usr/bin/env bash
# Pipeline parallelism against the single-process baseline: train the baseline and one pipeline run
# per schedule, plot the loss curves and the measured timelines into $PLOTS. The last lines say what the
# equivalence contract (every step within 1e-4 of the baseline) found for each schedule; a breach exits 1.
# The parallel program's arguments (its backend's GPUs too) are checked first, for every schedule.
#
#   bash run_pipeline.sh                                        # cnn, 4 stages, gpipe, 1f1b and 2bw, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_pipeline.sh               # no network
#   SCHEDULE="1f1b interleaved" MICROBATCHES=8 MODEL=vit DATA=synthetic bash run_pipeline.sh --layers 6
#   SCHEDULE="1f1b zb" RECOMPUTE=1 DATA=synthetic bash run_pipeline.sh    # zero bubble; re-materialisation
#   SCHEDULE="1f1b 2bw" DATA=synthetic bash run_pipeline.sh    # PipeDream-2BW on its --delay 1 reference
#   BALANCE=auto DATA=synthetic bash run_pipeline.sh                       # stages split by counted cost
#
# At DATA=synthetic and the other defaults (300 steps) it took about 3 minutes on 2 CPU cores shared with other
# jobs (measured 2026-11-28: docs/results.md); CIFAR-10 adds its download once.
#
# Knobs (environment, with defaults); extra arguments go to both programs, so they must be flags
# both take (--layers, --hidden, --lr, ...); a flag that has a knob is refused: set the knob.
set -euo pipefail
cd "$(dirname "$0")"
source ./mp/tools/launch_checks.sh   # knobs, the checks, the files' names, the exits: shared
STEP="the argument check"
if [ -n "${SCHEDULES:-}" ]; then       # SCHEDULE's old name here; every launcher now spells it SCHEDULE
    if [ -n "${SCHEDULE:-}" ]; then
        launcher_error "SCHEDULES=\"$SCHEDULES\" and SCHEDULE=\"$SCHEDULE\" are both set; SCHEDULES is SCHEDULE's old name: unset SCHEDULES"
    fi
    echo "note: SCHEDULES is SCHEDULE's old name (every launcher spells it SCHEDULE now): running SCHEDULE=\"$SCHEDULES\"" >&2
    SCHEDULE=$SCHEDULES
    unset SCHEDULES
fi

knob NPROC "4"                         # pipeline stages = number of ranks
knob MODEL "cnn"                       # cnn | mlp | vit | gpt (a causal language model on bytes)
knob STEPS "300"
knob DATA "auto"                       # auto | cifar10 | synthetic (the gpt: auto | shakespeare | synthetic)
knob MICROBATCHES "4"
knob SCHEDULE "gpipe 1f1b 2bw"        # a list: any of gpipe 1f1b interleaved zb zbv 2bw (2bw: MICROBATCHES >= NPROC)
knob RECOMPUTE "0"                     # 1: --recompute (keep only stage inputs, re-run forwards before B)
knob VIRTUAL_STAGES "2"                # interleaved only
knob BALANCE ""                        # blocks per stage (chunk), e.g. 1,1,1,2, or auto (mp/pp/balance.py); empty: even
knob BACKEND "auto"                    # auto | gloo | nccl
knob BATCH_SIZE "64"
shared_knobs                           # SEED EVAL_EVERY ACTIVATION OPTIMIZER DROPOUT CLIP CHECKPOINT_DIR
                                       # SAVE_EVERY RESTARTS CHECK_ONLY LOGS PLOTS PYTHON: mp/tools/launch_checks.sh

require_python
check_environment
SCHEDULE_LIST=$SCHEDULE                # the loops below name each schedule SCHEDULE in turn
# flag:KNOB:kind of value (n: a number, w: a word, -: none); kind n and w rewrite the programs' errors
KNOBS=(--model:MODEL:w --steps:STEPS:n --data:DATA:w --batch-size:BATCH_SIZE:n --seed:SEED:n
       --eval-every:EVAL_EVERY:n --backend:BACKEND:w --microbatches:MICROBATCHES:n --schedule:SCHEDULE:w
       --virtual-stages:VIRTUAL_STAGES:n --recompute:RECOMPUTE=1:- --log-file:LOGS:- --timeline:LOGS:-
       --balance:BALANCE:w --activation:ACTIVATION:w --optimizer:OPTIMIZER:w --dropout:DROPOUT:n
       --clip-grad-norm:CLIP:n --checkpoint-dir:CHECKPOINT_DIR:w --save-every:SAVE_EVERY:n)
check_knob RECOMPUTE "$RECOMPUTE" 0 1
check_count NPROC "$NPROC"
refuse_knob_flags "$@"

COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "$@")
EXTRA=$(flags_tag "$@")                # e.g. _layers6: runs with other sizes keep their own logs
run_knobs                              # ACTIVATION, OPTIMIZER, DROPOUT, CLIP (both programs, log names), RESTARTS
BASELINE_LOG="$LOGS/single_baseline_${MODEL}${EXTRA}_b${BATCH_SIZE}.jsonl"
SUFFIX="" DOING=""                     # what the knobs change, in the file names and on the console
if [ "$RECOMPUTE" = 1 ]; then SUFFIX="_recompute" DOING=", --recompute"; fi
balance_knob
if [ -n "$BALANCE" ]; then SUFFIX+=$BALANCE_TAG DOING+=", --balance $BALANCE"; fi
# the plots' names: every knob off its default (the default run's plots keep the README's names)
PLOT_TAG=$(settings_tag MODEL NPROC MICROBATCHES SCHEDULE VIRTUAL_STAGES BATCH_SIZE)$EXTRA$SUFFIX

pipeline_flags() { if [ "$1" = interleaved ]; then echo --virtual-stages "$VIRTUAL_STAGES"; fi
                  if [ "$RECOMPUTE" = 1 ]; then echo --recompute; fi
                  echo "${BALANCE_FLAGS[@]}"; }
# the parallel program's arguments at its world size, for every schedule, before anything trains
checkpoint_flags "$LOGS/any.jsonl"     # with CHECKPOINT_DIR, checked as the runs will take it
for SCHEDULE in $SCHEDULE_LIST; do
    check_args pipeline_microbatch "${COMMON[@]}" --backend "$BACKEND" --schedule "$SCHEDULE" \
        --microbatches "$MICROBATCHES" $(pipeline_flags "$SCHEDULE") "${CKPT[@]}"
done
check_baseline_args "${COMMON[@]}"
run_checks                             # all at once, without torch: mp/tools/check_args.py
start_stage                            # only now: a refused setting leaves nothing behind

STEP="the baseline (single_baseline.py)"
echo "== baseline: one process"
DELAY_LOG="${BASELINE_LOG%.jsonl}_delay1.jsonl" DELAY_PID=""
if [[ " $SCHEDULE_LIST " == *" 2bw "* ]]; then   # 2bw's own reference: the same stale-by-one rule in one process
    # beside the baseline: two one-process runs on two cores take the time of one. Its lines wait in a
    # file until it ends (two progress lines at once would interleave); leaving early stops it.
    echo "== baseline with --delay 1 (PipeDream-2BW's update rule): one process, beside it (its lines follow)"
    DELAY_OUT=$(mktemp)
    trap 'if [ -n "$DELAY_PID" ]; then kill "$DELAY_PID" 2>/dev/null || true; fi; rm -f "$DELAY_OUT"' EXIT
    run_python single_baseline.py "${COMMON[@]}" --delay 1 --log-file "$DELAY_LOG" > "$DELAY_OUT" 2>&1 &
    DELAY_PID=$!
fi
run_python single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"
if [ -n "$DELAY_PID" ]; then
    STEP="the 2bw reference (single_baseline.py --delay 1)"
    DELAY_STATUS=0
    wait "$DELAY_PID" || DELAY_STATUS=$?
    DELAY_PID=""
    echo "== baseline with --delay 1: its lines"
    cat "$DELAY_OUT"
    if [ "$DELAY_STATUS" != 0 ]; then (exit "$DELAY_STATUS"); fi   # the ERR trap names the step and stops
fi

WROTE=("$BASELINE_LOG") LOGS_OF=() TRACES=() PIPEDREAM_LOG=""
if [[ " $SCHEDULE_LIST " == *" 2bw "* ]]; then WROTE+=("$DELAY_LOG"); fi
for SCHEDULE in $SCHEDULE_LIST; do
    RUN="${MODEL}${EXTRA}_${SCHEDULE}_p${NPROC}_m${MICROBATCHES}_b${BATCH_SIZE}"
    if [ "$SCHEDULE" = interleaved ]; then RUN="${RUN}_v${VIRTUAL_STAGES}"; fi
    LOG="$LOGS/pipeline_${RUN}${SUFFIX}.jsonl"
    TRACE="$LOGS/timeline_${RUN}${SUFFIX}.json"
    STEP="the $SCHEDULE pipeline (pipeline_microbatch.py on $NPROC ranks)"
    echo "== pipeline: $SCHEDULE, $NPROC stages, $MICROBATCHES microbatches$DOING"
    # "--" ends torchrun's own options, so that every later flag reaches the program
    checkpoint_flags "$LOG"
    run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
        pipeline_microbatch.py "${COMMON[@]}" --backend "$BACKEND" --schedule "$SCHEDULE" \
        --microbatches "$MICROBATCHES" $(pipeline_flags "$SCHEDULE") "${CKPT[@]}" --timeline "$TRACE" --log-file "$LOG"
    if [ "$SCHEDULE" = 2bw ]; then PIPEDREAM_LOG="$LOG"; else LOGS_OF+=("$LOG"); fi
    TRACES+=("$TRACE") WROTE+=("$LOG" "$TRACE")
done

STEP="the plot (python -m mp.tools.plot_curves)"
if [ ${#LOGS_OF[@]} -gt 0 ]; then
    plot_logs "$BASELINE_LOG" "${LOGS_OF[@]}" -o "$PLOTS/pipeline_loss${PLOT_TAG}.png"
    WROTE+=("$PLOTS/pipeline_loss${PLOT_TAG}.png")
fi
if [ -n "$PIPEDREAM_LOG" ]; then   # 2bw against its reference; the synchronous baseline beside, not compared
    plot_logs "$DELAY_LOG" "$PIPEDREAM_LOG" --beside "$BASELINE_LOG" -o "$PLOTS/pipeline_loss_2bw${PLOT_TAG}.png"
    WROTE+=("$PLOTS/pipeline_loss_2bw${PLOT_TAG}.png")
fi
run_python -m mp.tools.plot_curves --timeline "${TRACES[@]}" -o "$PLOTS/pipeline_timeline${PLOT_TAG}.png"
WROTE+=("$PLOTS/pipeline_timeline${PLOT_TAG}.png")
say_written "${WROTE[@]}"
