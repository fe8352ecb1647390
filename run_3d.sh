#!/usr/bin/env bash
# Data x pipeline x tensor parallelism against the single-process baseline: train both on the same
# global batch, plot both into $PLOTS/3d_loss<settings>.png. The last line says what the equivalence
# contract (every step within 1e-4 of the baseline) found; a breach exits 1. The parallel program's
# arguments (its backend's GPUs too) are checked first.
#
#   bash run_3d.sh                                     # 2 replicas x 2 stages x 2 tp ranks, cnn, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_3d.sh            # no network
#   DP=1 TP=2 NPROC=4 MODEL=vit DATA=synthetic bash run_3d.sh --hidden 64 --heads 4
#   MODEL=gpt DATA=synthetic bash run_3d.sh --tie-embeddings --loss-mask prefix   # vocabulary-parallel ends
#   DATA=synthetic DROPOUT=0.1 CLIP=1 bash run_3d.sh   # dropout and clipping, exact in every layout
#   DATA=synthetic CHECKPOINT_DIR=ck RESTARTS=1 bash run_3d.sh   # checkpoints; a killed rank resumes
#
# At DATA=synthetic and the other defaults (300 steps) it took about 1.5 minutes on 2 CPU cores shared with other
# jobs (measured 2026-11-28: docs/results.md); CIFAR-10 adds its download once.
#
# Knobs (environment, with defaults); extra arguments go to both programs, so they must be flags
# both take (--layers, --hidden, --lr, ...); a flag that has a knob is refused: set the knob.
set -euo pipefail
cd "$(dirname "$0")"
source ./mp/tools/launch_checks.sh   # knobs, the checks, the files' names, the exits: shared
STEP="the argument check"

knob DP "2"                            # data-parallel replicas
knob TP "2"                            # tensor-parallel ranks per stage
knob NPROC "8"                         # ranks; stages = NPROC / (DP x TP)
knob MICROBATCHES "4"                  # per replica, per step
knob SCHEDULE "1f1b"                   # gpipe | 1f1b | interleaved | zb | zbv (2bw runs in the pipeline and joint programs only)
knob RECOMPUTE "0"                     # 1: --recompute (keep only stage inputs, re-run forwards before B)
knob BALANCE ""                        # blocks per stage, e.g. 1,4, or auto (mp/pp/balance.py); empty: even
knob MODEL "cnn"                       # cnn | mlp | vit | gpt (a causal language model on bytes)
knob STEPS "300"
knob DATA "auto"                       # auto | cifar10 | synthetic (the gpt: auto | shakespeare | synthetic)
knob BACKEND "auto"                    # auto | gloo | nccl
knob BATCH_SIZE "64"                   # global: a multiple of DP x MICROBATCHES
knob ZERO "0"                          # 1: --zero 1, ZeRO-1 (each replica keeps the optimizer state of 1/DP of
                                       #   the parameters); 2: --zero 2, ZeRO-2 (and 1/DP of the gradients after
                                       #   the backward); 3: --zero 3, ZeRO-3 (and 1/DP of the weights between
                                       #   uses), the 3-D run only
shared_knobs                           # SEED EVAL_EVERY ACTIVATION OPTIMIZER DROPOUT CLIP CHECKPOINT_DIR
                                       # SAVE_EVERY RESTARTS CHECK_ONLY LOGS PLOTS PYTHON: mp/tools/launch_checks.sh

require_python
check_environment
# flag:KNOB:kind of value (n: a number, w: a word, -: none); kind n and w rewrite the programs' errors
KNOBS=(--model:MODEL:w --steps:STEPS:n --data:DATA:w --batch-size:BATCH_SIZE:n --seed:SEED:n
       --eval-every:EVAL_EVERY:n --backend:BACKEND:w --log-file:LOGS:- --dp:DP:n --tp:TP:n
       --microbatches:MICROBATCHES:n --schedule:SCHEDULE:w --recompute:RECOMPUTE=1:- --timeline:LOGS:-
       --balance:BALANCE:w --activation:ACTIVATION:w --optimizer:OPTIMIZER:w --dropout:DROPOUT:n
       --clip-grad-norm:CLIP:n --checkpoint-dir:CHECKPOINT_DIR:w --save-every:SAVE_EVERY:n --zero:ZERO:n)
check_knob RECOMPUTE "$RECOMPUTE" 0 1
check_count NPROC "$NPROC"
refuse_knob_flags "$@"

COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "$@")
PARALLEL=(--backend "$BACKEND" --dp "$DP" --tp "$TP" --microbatches "$MICROBATCHES" --schedule "$SCHEDULE")
SUFFIX=""
DOING=""                               # what the knobs change, on the console
if [ "$RECOMPUTE" = 1 ]; then PARALLEL+=(--recompute); SUFFIX="_recompute" DOING=", --recompute"; fi
balance_knob                           # BALANCE: the 3-D run's --balance, and its tag in the names
if [ -n "$BALANCE" ]; then PARALLEL+=("${BALANCE_FLAGS[@]}"); SUFFIX+=$BALANCE_TAG DOING+=", --balance $BALANCE"; fi
zero_knob                              # ZERO: the 3-D run's --zero, and its tag in the names
PARALLEL+=("${ZERO_FLAGS[@]}") SUFFIX+=$ZERO_TAG
if [ "$ZERO" != 0 ]; then DOING+=", --zero $ZERO"; fi
EXTRA=$(flags_tag "$@")                # e.g. _layers6: runs with other sizes keep their own logs
run_knobs                              # ACTIVATION, OPTIMIZER, DROPOUT, CLIP (both programs, log names), RESTARTS
BASELINE_LOG="$LOGS/single_baseline_${MODEL}${EXTRA}_b${BATCH_SIZE}.jsonl"
GRID_LOG="$LOGS/parallel_3d_${MODEL}${EXTRA}_${SCHEDULE}_dp${DP}_tp${TP}_n${NPROC}_m${MICROBATCHES}_b${BATCH_SIZE}${SUFFIX}.jsonl"
# the plot's name: every knob off its default (the default run's plot keeps the README's name)
PLOT="$PLOTS/3d_loss$(settings_tag MODEL NPROC DP TP MICROBATCHES SCHEDULE BATCH_SIZE)$EXTRA$SUFFIX.png"

# the parallel program's arguments at its world size, before anything trains (its checks in mp/cli.py)
check_args parallel_3d "${COMMON[@]}" "${PARALLEL[@]}" --log-file "$GRID_LOG"
check_baseline_args "${COMMON[@]}"
run_checks                             # all at once, without torch: mp/tools/check_args.py
start_stage                            # only now: a refused setting leaves nothing behind

STEP="the baseline (single_baseline.py)"
echo "== baseline: one process"
run_python single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"

STEP="the 3-D run (parallel_3d.py on $NPROC ranks)"
count() { [ "$1" = 1 ] && echo "$1 $2" || echo "$1 ${3:-$2s}"; }   # count 1 replica: "1 replica"; count 2 ...: "2 replicas"
echo "== 3-D: $(count "$DP" replica) x $(count $((NPROC / (DP * TP))) stage) x $(count "$TP" "tp rank"), $(count "$MICROBATCHES" microbatch microbatches) ($SCHEDULE$DOING)"
# "--" ends torchrun's own options, so that every later flag reaches the program
checkpoint_flags "$GRID_LOG"
run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
    parallel_3d.py "${COMMON[@]}" "${PARALLEL[@]}" "${CKPT[@]}" --log-file "$GRID_LOG"

STEP="the plot (python -m mp.tools.plot_curves)"
plot_logs "$BASELINE_LOG" "$GRID_LOG" -o "$PLOT"
say_written "$BASELINE_LOG" "$GRID_LOG" "$PLOT"
