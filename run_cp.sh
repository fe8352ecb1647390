#!/usr/bin/env bash
# Context parallelism against the single-process baseline: train the vit in one process, then with its
# sequence split over NPROC ranks for each attention in ATTENTION, and plot them all into
# $PLOTS/cp_loss<settings>.png. The last lines say what the equivalence contract (every step within 1e-4
# of the baseline) found; a breach exits 1. The parallel program's arguments (its backend's GPUs too)
# are checked first.
#
#   bash run_cp.sh                                    # the vit, 2 ranks, ring and Ulysses, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_cp.sh           # no network
#   NPROC=4 PATCH_SIZE=2 DATA=synthetic bash run_cp.sh --hidden 64   # 256 tokens, 64 a rank
#   MODEL=gpt NPROC=4 DATA=synthetic bash run_cp.sh --loss-mask prefix   # causal: the zigzag ring, causal Ulysses
#
# At DATA=synthetic and the other defaults (300 steps) it took about 8 minutes on 2 CPU cores shared with other
# jobs (measured 2026-11-28: docs/results.md); CIFAR-10 adds its download once.
#
# Knobs (environment, with defaults); extra arguments go to both programs, so they must be flags
# both take (--layers, --hidden, --heads, --lr, ...); a flag that has a knob is refused: set the knob.
set -euo pipefail
cd "$(dirname "$0")"
source ./mp/tools/launch_checks.sh   # knobs, the checks, the files' names, the exits: shared
STEP="the argument check"

knob MODEL "vit"                       # vit | gpt (a causal language model on bytes: --cp-layout zigzag by default)
knob NPROC "2"                         # context-parallel degree = number of ranks
knob ATTENTION "ring ulysses"          # a list: ring and/or ulysses (ulysses: --heads divisible by NPROC)
knob PATCH_SIZE "4"                    # the vit's patch: 4 = 64 tokens, 2 = 256, 1 = 1024 (the gpt: --seq-len)
knob STEPS "300"
knob DATA "auto"                       # auto | cifar10 | synthetic (the gpt: auto | shakespeare | synthetic)
knob BACKEND "auto"                    # auto | gloo | nccl
knob BATCH_SIZE "64"
shared_knobs                           # SEED EVAL_EVERY ACTIVATION OPTIMIZER DROPOUT CLIP CHECKPOINT_DIR
                                       # SAVE_EVERY RESTARTS CHECK_ONLY LOGS PLOTS PYTHON: mp/tools/launch_checks.sh

require_python
check_environment
ATTENTION_LIST=$ATTENTION              # the loops below name each attention ATTENTION in turn
# flag:KNOB:kind of value (n: a number, w: a word, -: none); kind n and w rewrite the programs' errors
KNOBS=(--model:MODEL:w --steps:STEPS:n --data:DATA:w --batch-size:BATCH_SIZE:n --seed:SEED:n --eval-every:EVAL_EVERY:n
       --backend:BACKEND:w --attention:ATTENTION:w --patch-size:PATCH_SIZE:n --log-file:LOGS:-
       --activation:ACTIVATION:w --optimizer:OPTIMIZER:w --dropout:DROPOUT:n --clip-grad-norm:CLIP:n
       --checkpoint-dir:CHECKPOINT_DIR:w --save-every:SAVE_EVERY:n)
check_count NPROC "$NPROC"
if [ -z "$ATTENTION_LIST" ]; then launcher_error "ATTENTION is empty: name ring, ulysses or both"; fi
for ATTENTION in $ATTENTION_LIST; do check_knob ATTENTION "$ATTENTION" ring ulysses; done
ATTENTION=$ATTENTION_LIST                # the whole list again, for the plot's name
trains_models "the models with a sequence of tokens to split over the ranks" "vit gpt" "$@"
refuse_knob_flags "$@"
if [ "$MODEL" = gpt ] && [ "$PATCH_SIZE" != 4 ]; then
    launcher_error "PATCH_SIZE=$PATCH_SIZE is the vit's; the gpt's sequence is --seq-len (e.g. --seq-len 128)"
fi
SEQUENCE=(--patch-size "$PATCH_SIZE")  # the vit's tokens; the gpt's come from --seq-len (its own default: 64)
if [ "$MODEL" = gpt ]; then SEQUENCE=(); fi

COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "${SEQUENCE[@]}" "$@")
EXTRA=$(flags_tag "$@")$(settings_tag PATCH_SIZE)   # e.g. _layers6_patchsize2: other sizes keep their own logs
run_knobs                              # ACTIVATION, OPTIMIZER, DROPOUT, CLIP (both programs, log names), RESTARTS
BASELINE_LOG="$LOGS/single_baseline_${MODEL}${EXTRA}_b${BATCH_SIZE}.jsonl"
# the plot's name: every knob off its default (the default run's plot keeps the README's name)
PLOT="$PLOTS/cp_loss$(settings_tag MODEL NPROC ATTENTION BATCH_SIZE)$EXTRA.png"

# the parallel program's arguments at its world size, for every attention, before anything trains
checkpoint_flags "$LOGS/any.jsonl"     # with CHECKPOINT_DIR, checked as the runs will take it
for ATTENTION in $ATTENTION_LIST; do
    check_args context_parallel "${COMMON[@]}" --backend "$BACKEND" --attention "$ATTENTION" "${CKPT[@]}"
done
check_baseline_args "${COMMON[@]}"
run_checks                             # all at once, without torch: mp/tools/check_args.py
start_stage                            # only now: a refused setting leaves nothing behind

STEP="the baseline (single_baseline.py)"
echo "== baseline: one process"
run_python single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"

LOGS_TO_PLOT=("$BASELINE_LOG")
for ATTENTION in $ATTENTION_LIST; do
    LOG="$LOGS/context_parallel_${MODEL}${EXTRA}_cp${NPROC}_${ATTENTION}_b${BATCH_SIZE}.jsonl"
    STEP="the $ATTENTION run (context_parallel.py on $NPROC ranks)"
    echo "== context parallel: $ATTENTION attention, the sequence over $NPROC ranks"
    # "--" ends torchrun's own options, so that every later flag reaches the program
    checkpoint_flags "$LOG"
    run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
        context_parallel.py "${COMMON[@]}" --backend "$BACKEND" --attention "$ATTENTION" "${CKPT[@]}" --log-file "$LOG"
    LOGS_TO_PLOT+=("$LOG")
done

STEP="the plot (python -m mp.tools.plot_curves)"
plot_logs "${LOGS_TO_PLOT[@]}" -o "$PLOT"
say_written "${LOGS_TO_PLOT[@]}" "$PLOT"
