#!/usr/bin/env bash
# Expert parallelism against the single-process baseline: train the vit with its feed-forward blocks as a
# mixture of EXPERTS experts in one process, then with the experts spread over NPROC ranks (each rank also
# trains its slice of the batch), and plot both into $PLOTS/ep_loss<settings>.png: the loss curves, their
# difference (the equivalence contract wants <= 1e-4 at every step where the routing is the baseline's)
# and the tokens each expert got per step. The last line says what held: exact to X until the routing
# first differs at step S, or every step; a breach exits 1. The parallel program's arguments (its
# backend's GPUs too) are checked first.
#
#   bash run_ep.sh                                        # 4 experts over 2 ranks, top-1, dropless, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_ep.sh               # no network
#   NPROC=4 EXPERTS=8 TOP_K=2 CAPACITY=1.25 DATA=synthetic bash run_ep.sh --hidden 64   # capacity drops tokens
#
# At DATA=synthetic and the other defaults (300 steps) it took about 6 minutes on 2 CPU cores shared with other
# jobs (measured 2026-11-28: docs/results.md); CIFAR-10 adds its download once.
#
# Knobs (environment, with defaults); extra arguments go to both programs, so they must be flags
# both take (--layers, --hidden, --heads, --aux-loss, --lr, ...); a flag that has a knob is refused: set the knob.
set -euo pipefail
cd "$(dirname "$0")"
source ./mp/tools/launch_checks.sh   # knobs, the checks, the files' names, the exits: shared
STEP="the argument check"

knob MODEL "vit"                       # vit | gpt (a causal language model on bytes)
knob NPROC "2"                         # ranks; each holds EXPERTS/NPROC experts and trains BATCH_SIZE/NPROC samples
knob EXPERTS "4"                       # experts in each feed-forward block (divisible by NPROC)
knob TOP_K "1"                         # 1 | 2: experts per token
knob CAPACITY ""                       # capacity factor C: an expert runs at most ceil(C*K*tokens/E) (empty: dropless)
knob STEPS "300"
knob DATA "auto"                       # auto | cifar10 | synthetic (the gpt: auto | shakespeare | synthetic)
knob BACKEND "auto"                    # auto | gloo | nccl
knob BATCH_SIZE "64"
shared_knobs                           # SEED EVAL_EVERY ACTIVATION OPTIMIZER DROPOUT CLIP CHECKPOINT_DIR
                                       # SAVE_EVERY RESTARTS CHECK_ONLY LOGS PLOTS PYTHON: mp/tools/launch_checks.sh

require_python
check_environment
# flag:KNOB:kind of value (n: a number, w: a word, -: none); kind n and w rewrite the programs' errors
KNOBS=(--model:MODEL:w --steps:STEPS:n --data:DATA:w --batch-size:BATCH_SIZE:n --seed:SEED:n --eval-every:EVAL_EVERY:n
       --backend:BACKEND:w --experts:EXPERTS:n --top-k:TOP_K:n --capacity-factor:CAPACITY:n --log-file:LOGS:-
       --activation:ACTIVATION:w --optimizer:OPTIMIZER:w --dropout:DROPOUT:n --clip-grad-norm:CLIP:n
       --checkpoint-dir:CHECKPOINT_DIR:w --save-every:SAVE_EVERY:n)
check_count NPROC "$NPROC"
check_count EXPERTS "$EXPERTS"
check_knob TOP_K "$TOP_K" 1 2
trains_models "the models whose feed-forward blocks become experts" "vit gpt" "$@"
refuse_knob_flags "$@"

MOE=(--experts "$EXPERTS" --top-k "$TOP_K")
MOE_TAG="_e${EXPERTS}_k${TOP_K}"       # always in the names: a mixture's logs never take a dense run's name
if [ -n "$CAPACITY" ]; then MOE+=(--capacity-factor "$CAPACITY") MOE_TAG+="_c${CAPACITY}"; fi
COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" "${MOE[@]}" "$@")
EXTRA=$(flags_tag "$@")                # e.g. _hidden64: other sizes keep their own logs
run_knobs                              # ACTIVATION, OPTIMIZER, DROPOUT, CLIP (both programs, log names), RESTARTS
BASELINE_LOG="$LOGS/single_baseline_${MODEL}${MOE_TAG}${EXTRA}_b${BATCH_SIZE}.jsonl"
LOG="$LOGS/expert_parallel_${MODEL}${MOE_TAG}${EXTRA}_ep${NPROC}_b${BATCH_SIZE}.jsonl"
# the plot's name: every knob off its default (the default run's plot keeps the README's name)
PLOT="$PLOTS/ep_loss$(settings_tag MODEL NPROC EXPERTS TOP_K CAPACITY BATCH_SIZE)$EXTRA.png"

# both programs' arguments, the parallel one's at its world size, before anything trains
checkpoint_flags "$LOG"                # with CHECKPOINT_DIR, checked as the run will take it
check_args expert_parallel "${COMMON[@]}" --backend "$BACKEND" "${CKPT[@]}"
check_baseline_args "${COMMON[@]}"
run_checks                             # all at once, without torch: mp/tools/check_args.py
start_stage                            # only now: a refused setting leaves nothing behind

STEP="the baseline (single_baseline.py)"
echo "== baseline: one process, all $EXPERTS experts"
run_python single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"

STEP="the expert-parallel run (expert_parallel.py on $NPROC ranks)"
echo "== expert parallel: $EXPERTS experts over $NPROC ranks, top-$TOP_K, ${CAPACITY:+capacity factor }${CAPACITY:-dropless}"
# "--" ends torchrun's own options, so that every later flag reaches the program
run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
    expert_parallel.py "${COMMON[@]}" --backend "$BACKEND" "${CKPT[@]}" --log-file "$LOG"

STEP="the plot (python -m mp.tools.plot_curves)"
plot_logs "$BASELINE_LOG" "$LOG" -o "$PLOT"
say_written "$BASELINE_LOG" "$LOG" "$PLOT"
