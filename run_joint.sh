#!/usr/bin/env bash
# Data + pipeline parallelism against the single-process baseline: train both on the same global
# batch, plot both into $PLOTS/joint_loss.png; plot_curves.py prints the largest per-step
# |loss difference| (the equivalence contract wants <= 1e-4). The parallel program's arguments
# are checked first.
#
#   bash run_joint.sh                                  # 2 pipelines x 3 stages x 3 microbatches, cnn, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_joint.sh         # no network
#   DP=3 NPROC=6 MICROBATCHES=2 SCHEDULE=gpipe DATA=synthetic bash run_joint.sh
#
# Knobs (environment, with defaults); extra arguments go to both programs.
set -euo pipefail
# a failed step stops the script here, with its name, before anything later is plotted
trap 'rc=$?; echo "$(basename "$0"): stopped: this step failed with exit status $rc: $BASH_COMMAND" >&2' ERR

DP=${DP:-2}                            # data-parallel pipelines
NPROC=${NPROC:-6}                      # ranks; stages = NPROC / DP
MICROBATCHES=${MICROBATCHES:-3}        # per pipeline, per step
SCHEDULE=${SCHEDULE:-1f1b}             # gpipe | 1f1b | interleaved (2 chunks per stage: more blocks than the cnn's 5,
                                       #   e.g. SCHEDULE=interleaved MODEL=vit bash run_joint.sh --layers 4)
MODEL=${MODEL:-cnn}                    # cnn | mlp | vit
STEPS=${STEPS:-300}
DATA=${DATA:-auto}                     # auto | cifar10 | synthetic
BACKEND=${BACKEND:-auto}               # auto | gloo | nccl
BATCH_SIZE=${BATCH_SIZE:-72}           # global: a multiple of DP x MICROBATCHES
SEED=${SEED:-0}
EVAL_EVERY=${EVAL_EVERY:-50}
LOGS=${LOGS:-logs}
PLOTS=${PLOTS:-$LOGS/plots}            # PLOTS=plots rewrites the committed figures (docs/running.md)
PLOT="$PLOTS/joint_loss.png"
PYTHON=${PYTHON:-python}

cd "$(dirname "$0")"
mkdir -p "$LOGS" "$PLOTS"
COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "$@")
BASELINE_LOG="$LOGS/single_baseline_${MODEL}_b${BATCH_SIZE}.jsonl"
JOINT_LOG="$LOGS/pipeline_dp_joint_${MODEL}_dp${DP}_n${NPROC}_m${MICROBATCHES}.jsonl"

# the parallel program's arguments at its world size, before anything trains (parse_args only)
WORLD_SIZE=$NPROC "$PYTHON" -c 'import sys, pipeline_dp_joint as p; p.parse_args(sys.argv[1:])' \
    "${COMMON[@]}" --backend "$BACKEND" --dp "$DP" --microbatches "$MICROBATCHES" --schedule "$SCHEDULE" \
    --log-file "$JOINT_LOG"

echo "== baseline: one process"
"$PYTHON" single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"

echo "== joint: $DP pipelines x $((NPROC / DP)) stages x $MICROBATCHES microbatches ($SCHEDULE)"
# "--" ends torchrun's own options, so that every later flag reaches the program
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -- \
    pipeline_dp_joint.py "${COMMON[@]}" --backend "$BACKEND" --dp "$DP" --microbatches "$MICROBATCHES" \
    --schedule "$SCHEDULE" --log-file "$JOINT_LOG"

"$PYTHON" plot_curves.py "$BASELINE_LOG" "$JOINT_LOG" -o "$PLOT"
echo "plot: $PLOT"
