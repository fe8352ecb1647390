#!/usr/bin/env bash
# Data x pipeline x tensor parallelism against the single-process baseline: train both on the same
# global batch, plot both into $PLOTS/3d_loss.png; plot_curves.py prints the largest per-step
# |loss difference| (the equivalence contract wants <= 1e-4). The parallel program's arguments
# are checked first.
#
#   bash run_3d.sh                                     # 2 replicas x 2 stages x 2 tp ranks, cnn, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_3d.sh            # no network
#   DP=1 TP=2 NPROC=4 MODEL=vit DATA=synthetic bash run_3d.sh --hidden 64 --heads 4
#
# Knobs (environment, with defaults); extra arguments go to both programs.
set -euo pipefail
# a failed step stops the script here, with its name, before anything later is plotted
trap 'rc=$?; echo "$(basename "$0"): stopped: this step failed with exit status $rc: $BASH_COMMAND" >&2' ERR

DP=${DP:-2}                            # data-parallel replicas
TP=${TP:-2}                            # tensor-parallel ranks per stage
NPROC=${NPROC:-8}                      # ranks; stages = NPROC / (DP x TP)
MICROBATCHES=${MICROBATCHES:-4}        # per replica, per step
SCHEDULE=${SCHEDULE:-1f1b}             # any --schedule of pipeline_microbatch.py
MODEL=${MODEL:-cnn}                    # cnn | mlp | vit
STEPS=${STEPS:-300}
DATA=${DATA:-auto}                     # auto | cifar10 | synthetic
BACKEND=${BACKEND:-auto}               # auto | gloo | nccl
BATCH_SIZE=${BATCH_SIZE:-64}           # global: a multiple of DP x MICROBATCHES
SEED=${SEED:-0}
EVAL_EVERY=${EVAL_EVERY:-50}
LOGS=${LOGS:-logs}
PLOTS=${PLOTS:-$LOGS/plots}            # PLOTS=plots rewrites the committed figures (docs/running.md)
PLOT="$PLOTS/3d_loss.png"
PYTHON=${PYTHON:-python}

cd "$(dirname "$0")"
mkdir -p "$LOGS" "$PLOTS"
COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "$@")
PARALLEL=(--backend "$BACKEND" --dp "$DP" --tp "$TP" --microbatches "$MICROBATCHES" --schedule "$SCHEDULE")
BASELINE_LOG="$LOGS/single_baseline_${MODEL}_b${BATCH_SIZE}.jsonl"
GRID_LOG="$LOGS/parallel_3d_${MODEL}_dp${DP}_tp${TP}_n${NPROC}_m${MICROBATCHES}.jsonl"

# the parallel program's arguments at its world size, before anything trains (parse_args only)
WORLD_SIZE=$NPROC "$PYTHON" -c 'import sys, parallel_3d as p; p.parse_args(sys.argv[1:])' \
    "${COMMON[@]}" "${PARALLEL[@]}" --log-file "$GRID_LOG"

echo "== baseline: one process"
"$PYTHON" single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"

echo "== 3-D: $DP replicas x $((NPROC / (DP * TP))) stages x $TP tp ranks, $MICROBATCHES microbatches ($SCHEDULE)"
# "--" ends torchrun's own options, so that every later flag reaches the program
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -- \
    parallel_3d.py "${COMMON[@]}" "${PARALLEL[@]}" --log-file "$GRID_LOG"

"$PYTHON" plot_curves.py "$BASELINE_LOG" "$GRID_LOG" -o "$PLOT"
echo "plot: $PLOT"
