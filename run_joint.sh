#!/usr/bin/env bash
# Data + pipeline parallelism against the single-process baseline: train both on the same global
# batch, plot both into $PLOTS/joint_loss<settings>.png. The last line says what the equivalence
# contract (every step within 1e-4 of the baseline) found; a breach exits 1. The parallel program's
# arguments (its backend's GPUs too) are checked first.
#
#   bash run_joint.sh                                  # 2 pipelines x 3 stages x 3 microbatches, cnn, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_joint.sh         # no network
#   DP=3 NPROC=6 MICROBATCHES=2 SCHEDULE=gpipe DATA=synthetic bash run_joint.sh
#   SCHEDULE=2bw DATA=synthetic bash run_joint.sh      # PipeDream-2BW in each pipeline, on its --delay 1 reference
#
# At DATA=synthetic and the other defaults (300 steps) it took about 1 minute on 2 CPU cores shared with other
# jobs (measured 2026-11-28: docs/results.md); CIFAR-10 adds its download once.
#
# Knobs (environment, with defaults); extra arguments go to both programs, so they must be flags
# both take (--layers, --hidden, --lr, ...); a flag that has a knob is refused: set the knob.
set -euo pipefail
cd "$(dirname "$0")"
source ./mp/tools/launch_checks.sh   # knobs, the checks, the files' names, the exits: shared
STEP="the argument check"

knob DP "2"                            # data-parallel pipelines
knob NPROC "6"                         # ranks; stages = NPROC / DP
knob MICROBATCHES "3"                  # per pipeline, per step
knob BALANCE ""                        # blocks per stage, e.g. 1,1,3, or auto (mp/pp/balance.py); empty: even
knob SCHEDULE "1f1b"                   # gpipe | 1f1b | interleaved (2 chunks per stage: more blocks than the cnn's 5,
                                       #   e.g. SCHEDULE=interleaved MODEL=vit bash run_joint.sh --layers 4) | zb | zbv
                                       #   | 2bw (PipeDream-2BW; the baseline then runs --delay 1, its reference)
knob MODEL "cnn"                       # cnn | mlp | vit | gpt (a causal language model on bytes)
knob STEPS "300"
knob DATA "auto"                       # auto | cifar10 | synthetic (the gpt: auto | shakespeare | synthetic)
knob BACKEND "auto"                    # auto | gloo | nccl
knob BATCH_SIZE "72"                   # global: a multiple of DP x MICROBATCHES
knob ZERO "0"                          # 1: --zero 1, ZeRO-1 (each replica keeps the optimizer state of 1/DP of
                                       #   the parameters); 2: --zero 2, ZeRO-2 (and 1/DP of the gradients after
                                       #   the backward); 3: --zero 3, ZeRO-3 (and 1/DP of the weights between
                                       #   uses), the joint run only
shared_knobs                           # SEED EVAL_EVERY ACTIVATION OPTIMIZER DROPOUT CLIP CHECKPOINT_DIR
                                       # SAVE_EVERY RESTARTS CHECK_ONLY LOGS PLOTS PYTHON: mp/tools/launch_checks.sh

require_python
check_environment
# flag:KNOB:kind of value (n: a number, w: a word, -: none); kind n and w rewrite the programs' errors
KNOBS=(--model:MODEL:w --steps:STEPS:n --data:DATA:w --batch-size:BATCH_SIZE:n --seed:SEED:n
       --eval-every:EVAL_EVERY:n --backend:BACKEND:w --log-file:LOGS:- --dp:DP:n --microbatches:MICROBATCHES:n
       --schedule:SCHEDULE:w --timeline:LOGS:- --balance:BALANCE:w
       --activation:ACTIVATION:w --optimizer:OPTIMIZER:w --dropout:DROPOUT:n --clip-grad-norm:CLIP:n
       --checkpoint-dir:CHECKPOINT_DIR:w --save-every:SAVE_EVERY:n --zero:ZERO:n)
check_count NPROC "$NPROC"
refuse_knob_flags "$@"

COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "$@")
EXTRA=$(flags_tag "$@")                # e.g. _layers6: runs with other sizes keep their own logs
run_knobs                              # ACTIVATION, OPTIMIZER, DROPOUT, CLIP (both programs, log names), RESTARTS
BASELINE_LOG="$LOGS/single_baseline_${MODEL}${EXTRA}_b${BATCH_SIZE}.jsonl"
DELAY=()                               # 2bw trains by another rule: its reference is the baseline with --delay 1
if [ "$SCHEDULE" = 2bw ]; then DELAY=(--delay 1) BASELINE_LOG="${BASELINE_LOG%.jsonl}_delay1.jsonl"; fi
balance_knob                           # BALANCE: the joint run's --balance, and its tag in the names
zero_knob                              # ZERO: the joint run's --zero, and its tag in the names
JOINT_LOG="$LOGS/pipeline_dp_joint_${MODEL}${EXTRA}_${SCHEDULE}_dp${DP}_n${NPROC}_m${MICROBATCHES}_b${BATCH_SIZE}"
JOINT_LOG+="${BALANCE_TAG}${ZERO_TAG}.jsonl"
# the plot's name: every knob off its default (the default run's plot keeps the README's name)
PLOT="$PLOTS/joint_loss$(settings_tag MODEL NPROC DP MICROBATCHES SCHEDULE BATCH_SIZE)$EXTRA$BALANCE_TAG$ZERO_TAG.png"

# the parallel program's arguments at its world size, before anything trains (its checks in mp/cli.py)
check_args pipeline_dp_joint "${COMMON[@]}" --backend "$BACKEND" --dp "$DP" --microbatches "$MICROBATCHES" \
    --schedule "$SCHEDULE" "${BALANCE_FLAGS[@]}" "${ZERO_FLAGS[@]}" --log-file "$JOINT_LOG"
check_baseline_args "${COMMON[@]}"
run_checks                             # all at once, without torch: mp/tools/check_args.py
start_stage                            # only now: a refused setting leaves nothing behind

STEP="the baseline (single_baseline.py${DELAY:+ --delay 1})"
echo "== baseline${DELAY:+ with --delay 1, the 2bw reference}: one process"
run_python single_baseline.py "${COMMON[@]}" "${DELAY[@]}" --log-file "$BASELINE_LOG"

STEP="the joint run (pipeline_dp_joint.py on $NPROC ranks)"
echo "== joint: $DP pipelines x $((NPROC / DP)) stages x $MICROBATCHES microbatches ($SCHEDULE)"
# "--" ends torchrun's own options, so that every later flag reaches the program
checkpoint_flags "$JOINT_LOG"
run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
    pipeline_dp_joint.py "${COMMON[@]}" --backend "$BACKEND" --dp "$DP" --microbatches "$MICROBATCHES" \
    --schedule "$SCHEDULE" "${BALANCE_FLAGS[@]}" "${ZERO_FLAGS[@]}" "${CKPT[@]}" --log-file "$JOINT_LOG"

STEP="the plot (python -m mp.tools.plot_curves)"
plot_logs "$BASELINE_LOG" "$JOINT_LOG" -o "$PLOT"
say_written "$BASELINE_LOG" "$JOINT_LOG" "$PLOT"
