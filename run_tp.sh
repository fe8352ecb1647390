#!/usr/bin/env bash
# Tensor parallelism against the single-process baseline: train both, plot both into
# $PLOTS/tp_loss<settings>.png. The last lines say what the equivalence contract (every step within 1e-4
# of the baseline) found; a breach exits 1. The parallel program's arguments (its backend's GPUs too)
# are checked first.
#
#   bash run_tp.sh                                   # cnn, degree 2, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_tp.sh          # no network
#   NPROC=4 MODEL=vit DATA=synthetic bash run_tp.sh --heads 4 --hidden 64
#   HYBRID=1 DATA=synthetic bash run_tp.sh            # cnn: also --hybrid, drawn on the same plot
#
# At DATA=synthetic and the other defaults (300 steps) it took about 2 minutes with HYBRID=1 (less without) on
# 2 CPU cores shared with other jobs (measured 2026-11-28: docs/results.md); CIFAR-10 adds its download once.
#
# Knobs (environment, with defaults); extra arguments go to both programs, so they must be flags
# both take (--layers, --hidden, --lr, ...); a flag that has a knob is refused: set the knob.
set -euo pipefail
cd "$(dirname "$0")"
source ./mp/tools/launch_checks.sh   # knobs, the checks, the files' names, the exits: shared
STEP="the argument check"

knob NPROC "2"                         # tensor-parallel degree = number of ranks
knob MODEL "cnn"                       # cnn | mlp | vit | gpt (a causal language model on bytes)
knob STEPS "300"
knob DATA "auto"                       # auto | cifar10 | synthetic (the gpt: auto | shakespeare | synthetic)
knob BACKEND "auto"                    # auto | gloo | nccl
knob HYBRID "0"                        # 1: also run --hybrid (cnn: data-parallel convolutions, tensor-parallel fc)
knob BATCH_SIZE "64"
shared_knobs                           # SEED EVAL_EVERY ACTIVATION OPTIMIZER DROPOUT CLIP CHECKPOINT_DIR
                                       # SAVE_EVERY RESTARTS CHECK_ONLY LOGS PLOTS PYTHON: mp/tools/launch_checks.sh

require_python
check_environment
# flag:KNOB:kind of value (n: a number, w: a word, -: none); kind n and w rewrite the programs' errors
KNOBS=(--model:MODEL:w --steps:STEPS:n --data:DATA:w --batch-size:BATCH_SIZE:n --seed:SEED:n
       --eval-every:EVAL_EVERY:n --backend:BACKEND:w --log-file:LOGS:- --hybrid:HYBRID=1:-
       --activation:ACTIVATION:w --optimizer:OPTIMIZER:w --dropout:DROPOUT:n --clip-grad-norm:CLIP:n
       --checkpoint-dir:CHECKPOINT_DIR:w --save-every:SAVE_EVERY:n)
check_knob HYBRID "$HYBRID" 0 1
check_count NPROC "$NPROC"
refuse_knob_flags "$@"
if [ "$HYBRID" = 1 ] && [ "$MODEL" != cnn ]; then
    launcher_error "HYBRID=1 needs MODEL=cnn (--hybrid runs the cnn's convolutions data-parallel), not MODEL=$MODEL"
fi

COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "$@")
EXTRA=$(flags_tag "$@")                # e.g. _layers6: runs with other sizes keep their own logs
run_knobs                              # ACTIVATION, OPTIMIZER, DROPOUT, CLIP (both programs, log names), RESTARTS
BASELINE_LOG="$LOGS/single_baseline_${MODEL}${EXTRA}_b${BATCH_SIZE}.jsonl"
TP_LOG="$LOGS/tensor_parallel_${MODEL}${EXTRA}_tp${NPROC}_b${BATCH_SIZE}.jsonl"
# the plot's name: every knob off its default (the default run's plot keeps the README's name)
PLOT="$PLOTS/tp_loss$(settings_tag MODEL NPROC BATCH_SIZE HYBRID)$EXTRA.png"

# the parallel program's arguments at its world size, before anything trains (its checks in mp/cli.py)
check_args tensor_parallel "${COMMON[@]}" --backend "$BACKEND" --log-file "$TP_LOG"
if [ "$HYBRID" = 1 ]; then check_args tensor_parallel "${COMMON[@]}" --hybrid --backend "$BACKEND"; fi
check_baseline_args "${COMMON[@]}"
run_checks                             # all at once, without torch: mp/tools/check_args.py
start_stage                            # only now: a refused setting leaves nothing behind

STEP="the baseline (single_baseline.py)"
echo "== baseline: one process"
run_python single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"

STEP="the tensor-parallel run (tensor_parallel.py on $NPROC ranks)"
echo "== tensor parallel: degree $NPROC"
# "--" ends torchrun's own options, so that every later flag reaches the program
checkpoint_flags "$TP_LOG"
run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
    tensor_parallel.py "${COMMON[@]}" --backend "$BACKEND" "${CKPT[@]}" --log-file "$TP_LOG"

LOGS_TO_PLOT=("$BASELINE_LOG" "$TP_LOG")
if [ "$HYBRID" = 1 ]; then
    HYBRID_LOG="$LOGS/tensor_parallel_${MODEL}${EXTRA}_tp${NPROC}_b${BATCH_SIZE}_hybrid.jsonl"
    STEP="the hybrid run (tensor_parallel.py --hybrid on $NPROC ranks)"
    echo "== hybrid: data-parallel convolutions, tensor-parallel fc layers, degree $NPROC"
    checkpoint_flags "$HYBRID_LOG"
    run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
        tensor_parallel.py "${COMMON[@]}" --hybrid --backend "$BACKEND" "${CKPT[@]}" --log-file "$HYBRID_LOG"
    LOGS_TO_PLOT+=("$HYBRID_LOG")
fi

STEP="the plot (python -m mp.tools.plot_curves)"
plot_logs "${LOGS_TO_PLOT[@]}" -o "$PLOT"
say_written "${LOGS_TO_PLOT[@]}" "$PLOT"
