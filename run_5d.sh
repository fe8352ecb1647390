#!/usr/bin/env bash
# Every axis at once against the single-process baseline: train the vit (a mixture of EXPERTS experts by
# default) in one process with --microbatches MICROBATCHES, then on NPROC ranks of a DP x PP x CP x TP mesh
# with the experts over EP ranks (parallel_5d.py), and plot both into $PLOTS/5d_loss<settings>.png with
# their difference (the equivalence contract wants <= 1e-4 wherever the routing is the baseline's;
# tests/test_5d.py asks 1e-6). The last line says what held; a breach exits 1. The parallel program's
# arguments (its backend's GPUs too) are checked first.
#
#   bash run_5d.sh                                    # 8 ranks: pp 2 x cp 2 x tp 2, 4 experts over ep 2, CIFAR-10
#   DATA=synthetic STEPS=100 bash run_5d.sh           # no network
#   NPROC=16 DP=2 EP=4 EXPERTS=8 SCHEDULE=interleaved DATA=synthetic bash run_5d.sh
#   EXPERTS=0 EP=1 DP=2 ZERO=3 CP=2 TP=1 NPROC=8 DATA=synthetic bash run_5d.sh   # dense, ZeRO-3 over dp x cp
#   MODEL=gpt DATA=synthetic bash run_5d.sh --loss-mask prefix --tie-embeddings   # the language model, causal cp
#
# At DATA=synthetic and the other defaults (300 steps, 8 ranks) it took about 13 minutes on 2 CPU cores shared
# with other jobs (measured 2026-11-28: the baseline's steps 6 minutes, the 8 ranks' 5); CIFAR-10 adds
# its download once.
#
# Knobs (environment, with defaults); extra arguments go to both programs, so they must be flags
# both take (--layers, --hidden, --heads, --aux-loss, --lr, ...); a flag that has a knob is refused: set the knob.
set -euo pipefail
cd "$(dirname "$0")"
source ./mp/tools/launch_checks.sh   # knobs, the checks, the files' names, the exits: shared
STEP="the argument check"

knob MODEL "vit"                       # vit | gpt (a causal language model on bytes: --cp-layout zigzag by default)
knob NPROC "8"                         # ranks; stages = NPROC / (DP x CP x TP)
knob DP "1"                            # data-parallel replicas
knob CP "2"                            # context-parallel ranks: each holds 1/CP of every sequence
knob TP "2"                            # tensor-parallel ranks per stage (the innermost axis)
knob EP "2"                            # expert-parallel ranks, folded over DP x CP (divides it)
knob EXPERTS "4"                       # experts in each feed-forward block (0: dense; divisible by EP)
knob TOP_K "2"                         # 1 | 2: experts per token
knob CAPACITY ""                       # capacity factor: an expert runs at most ceil(C*K*tokens/E) (empty: dropless)
knob MICROBATCHES "2"                  # per replica, per step; the baseline routes as many microbatches
knob SCHEDULE "1f1b"                   # gpipe | 1f1b | interleaved
knob ATTENTION "ring"                  # ring | ulysses
knob SP "0"                            # 1: --sequence-parallel
knob STEPS "300"
knob DATA "auto"                       # auto | cifar10 | synthetic (the gpt: auto | shakespeare | synthetic)
knob BACKEND "auto"                    # auto | gloo | nccl
knob BATCH_SIZE "64"                   # global: a multiple of DP x MICROBATCHES
knob ZERO "0"                          # 1, 2, 3: ZeRO of the dense weights over dp x cp, the experts over edp
shared_knobs                           # SEED EVAL_EVERY ACTIVATION OPTIMIZER DROPOUT CLIP CHECKPOINT_DIR
                                       # SAVE_EVERY RESTARTS CHECK_ONLY LOGS PLOTS PYTHON: mp/tools/launch_checks.sh

require_python
check_environment
# flag:KNOB:kind of value (n: a number, w: a word, -: none); kind n and w rewrite the programs' errors
KNOBS=(--model:MODEL:w --steps:STEPS:n --data:DATA:w --batch-size:BATCH_SIZE:n --seed:SEED:n --eval-every:EVAL_EVERY:n
       --backend:BACKEND:w --experts:EXPERTS:n --top-k:TOP_K:n --capacity-factor:CAPACITY:n --log-file:LOGS:-
       --dp:DP:n --cp:CP:n --tp:TP:n --ep:EP:n --microbatches:MICROBATCHES:n --schedule:SCHEDULE:w
       --attention:ATTENTION:w --sequence-parallel:SP=1:- --zero:ZERO:n
       --activation:ACTIVATION:w --optimizer:OPTIMIZER:w --dropout:DROPOUT:n --clip-grad-norm:CLIP:n
       --checkpoint-dir:CHECKPOINT_DIR:w --save-every:SAVE_EVERY:n)
check_count NPROC "$NPROC"
check_knob SP "$SP" 0 1
check_knob TOP_K "$TOP_K" 1 2
trains_models "the models every axis splits (their tokens over cp, their feed-forward blocks as experts over ep)" \
    "vit gpt" "$@"
refuse_knob_flags "$@"

MOE=() MOE_TAG=""                      # a mixture's logs never take a dense run's name
if [ "$EXPERTS" != 0 ]; then
    MOE=(--experts "$EXPERTS" --top-k "$TOP_K") MOE_TAG="_e${EXPERTS}_k${TOP_K}"
    if [ -n "$CAPACITY" ]; then MOE+=(--capacity-factor "$CAPACITY") MOE_TAG+="_c${CAPACITY}"; fi
fi
COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" --microbatches "$MICROBATCHES" "${MOE[@]}" "$@")
PARALLEL=(--backend "$BACKEND" --dp "$DP" --cp "$CP" --tp "$TP" --ep "$EP" --schedule "$SCHEDULE"
          --attention "$ATTENTION")
SUFFIX=""
if [ "$SP" = 1 ]; then PARALLEL+=(--sequence-parallel) SUFFIX="_sp"; fi
zero_knob                              # ZERO: the 5-D run's --zero, and its tag in the names
PARALLEL+=("${ZERO_FLAGS[@]}") SUFFIX+=$ZERO_TAG
EXTRA=$(flags_tag "$@")                # e.g. _hidden64: other sizes keep their own logs
run_knobs                              # ACTIVATION, OPTIMIZER, DROPOUT, CLIP (both programs, log names), RESTARTS
BASELINE_LOG="$LOGS/single_baseline_${MODEL}${MOE_TAG}${EXTRA}_b${BATCH_SIZE}_m${MICROBATCHES}.jsonl"
LOG="$LOGS/parallel_5d_${MODEL}${MOE_TAG}${EXTRA}_${SCHEDULE}_${ATTENTION}_dp${DP}_cp${CP}_tp${TP}_ep${EP}_n${NPROC}"
LOG+="_m${MICROBATCHES}_b${BATCH_SIZE}${SUFFIX}.jsonl"
# the plot's name: every knob off its default (the default run's plot keeps the README's name)
PLOT="$PLOTS/5d_loss$(settings_tag MODEL NPROC DP CP TP EP EXPERTS TOP_K CAPACITY MICROBATCHES SCHEDULE ATTENTION BATCH_SIZE)"
PLOT+="$EXTRA$SUFFIX.png"

# both programs' arguments, the parallel one's at its world size, before anything trains
checkpoint_flags "$LOG"                # with CHECKPOINT_DIR, checked as the run will take it
check_args parallel_5d "${COMMON[@]}" "${PARALLEL[@]}" "${CKPT[@]}" --log-file "$LOG"
check_baseline_args "${COMMON[@]}"
run_checks                             # all at once, without torch: mp/tools/check_args.py
start_stage                            # only now: a refused setting leaves nothing behind

STEP="the baseline (single_baseline.py)"
echo "== baseline: one process, $MICROBATCHES microbatches${EXPERTS:+, $EXPERTS experts}"
run_python single_baseline.py "${COMMON[@]}" --log-file "$BASELINE_LOG"

STEP="the 5-D run (parallel_5d.py on $NPROC ranks)"
echo "== 5-D: dp $DP x pp $((NPROC / (DP * CP * TP))) x cp $CP x tp $TP, ep $EP ($SCHEDULE, $ATTENTION${SUFFIX:+, ${SUFFIX#_}})"
# "--" ends torchrun's own options, so that every later flag reaches the program
run_python -m mp.tools.torchrun --standalone --nproc-per-node "$NPROC" "${TORCHRUN_OPTS[@]}" -- \
    parallel_5d.py "${COMMON[@]}" "${PARALLEL[@]}" "${CKPT[@]}" --log-file "$LOG"

STEP="the plot (python -m mp.tools.plot_curves)"
plot_logs "$BASELINE_LOG" "$LOG" -o "$PLOT"
say_written "$BASELINE_LOG" "$LOG" "$PLOT"
