#!/usr/bin/env bash
# The parallel programs on a Slurm cluster, as one job that spans several nodes. Slurm reserves
# the nodes and runs this script on the first of them. It trains the single-process baseline
# there; then `srun` starts one torchrun agent on each node, the agents meet at a rendezvous on the
# first node and start NPROC ranks each, so the program sees one world of nodes x NPROC ranks.
# Last, mp.tools.plot_curves draws both runs into $PLOTS/slurm-<job id>-<program>_<model>_loss.png and says what
# the equivalence contract (every step within 1e-4) found; a breach exits 1, as the other run_*.sh launchers do.
#
#   sbatch run_slurm.sh                                        # 2 nodes x 2 ranks: a 4-stage pipeline
#   sbatch --wait -N 2 run_slurm.sh                            # the same, and return when it is over
#   PROGRAM=pipeline_dp_joint.py NPROC=3 DP=2 sbatch run_slurm.sh   # one 3-stage pipeline per node
#   MODEL=mlp DATA=synthetic STEPS=100 sbatch --time=10 run_slurm.sh --layers 6   # extra flags: both programs
#   salloc -N 2 bash run_slurm.sh                              # inside an interactive allocation
#
# Submit it from the repository's root (Slurm runs a copy of this file, so the job finds the
# programs through the directory it was submitted from, or REPO=). The repository, LOGS and the
# data set must be on a file system that every node sees (your home directory usually is).
# docs/slurm.md explains every line, and what to change on a real cluster.
#
# What sbatch reads: the #SBATCH lines below are sbatch's defaults for this job; options on the
# sbatch command line override them (`sbatch -N 4 --time=2:00:00 run_slurm.sh`).
#SBATCH --job-name=model-parallel
#SBATCH --nodes=2                 # nodes; one torchrun agent runs on each
#SBATCH --ntasks-per-node=1       # one Slurm task per node: the torchrun agent, which starts NPROC ranks
#SBATCH --time=00:30:00           # a time limit: Slurm ends the job after it, so nothing waits forever
# GPUs: ask for them per node and set NPROC to the same number, e.g. `#SBATCH --gres=gpu:2` with
# NPROC=2 (then --backend auto picks nccl). CPUs: `#SBATCH --cpus-per-task=8` gives the agent's
# task 8 cores for its NPROC ranks. A partition (queue): `#SBATCH --partition=NAME` (`sinfo` lists them).
# Preemption: with `sbatch --requeue` Slurm may stop the job and start it again from the top;
# CHECKPOINT_DIR=DIR is passed as --checkpoint-dir, so the program resumes from its last
# checkpoint (docs/slurm.md, Requeue).
#
# Knobs (environment, with defaults; sbatch hands the submitting shell's environment to the job).
set -euo pipefail
# a failed step stops the script here, with its name, before anything later is plotted
# (a step interrupted by Ctrl-C or scancel has said so in one line and exits 130: leave quietly)
trap 'rc=$?; if [ $rc = 130 ]; then exit 130; fi
      echo "run_slurm.sh: stopped: this step failed with exit status $rc: $BASH_COMMAND" >&2' ERR
# --help / -h: this header and every knob with its default and meaning, at once (no Slurm, no python)
for arg in "$@"; do
    case "$arg" in -h | --help)
        echo "usage: [KNOB=value ...] sbatch run_slurm.sh [flags for both programs, e.g. --layers 6]"
        echo
        sed -n '2,/^set -euo pipefail/p' "$0" | sed -e '/^set -euo pipefail/d' -e '/^#SBATCH/!s/^# \{0,1\}//'
        sed -n '/^set -euo pipefail/,/^fail() {/p' "$0" |   # the knobs' block: NAME=${NAME:-default}  # meaning
            sed -nE 's/^([A-Z_]+)=\$\{[A-Z_]+:-([^}]*)\} *(# *)?(.*)$/\1\t"\2"\t\4/p' |
            awk -F'\t' '{ printf "  %-15s %-26s %s\n", $1, $2, $3 }' | sed 's/ *$//'
        echo
        echo "Writes the baseline's and the parallel run's logs under \$LOGS (default logs/) and the figure under"
        echo "\$PLOTS (default logs/plots/), named by the job id; docs/slurm.md explains every step."
        exit 0 ;;
    esac
done

PROGRAM=${PROGRAM:-pipeline_microbatch.py}  # pipeline_microbatch.py | pipeline_dp_joint.py | tensor_parallel.py | parallel_3d.py
NPROC=${NPROC:-2}                      # ranks per node (GPUs per node on a GPU cluster); world = nodes x NPROC
MICROBATCHES=${MICROBATCHES:-4}        # pipelines: microbatches per global batch (per replica)
SCHEDULE=${SCHEDULE:-1f1b}             # pipelines: gpipe | 1f1b | interleaved (2 chunks per rank) | zb | zbv | 2bw
                                       # (2bw: pipeline_microbatch.py; the baseline then runs --delay 1, its reference)
BALANCE=${BALANCE:-}                   # pipelines: blocks per stage, e.g. 1,1,1,2, or auto (mp/pp/balance.py); empty: even
ACTIVATION=${ACTIVATION:-gelu}         # gelu | relu: every model's activation, both programs (relu: the course's)
OPTIMIZER=${OPTIMIZER:-sgd}            # sgd | adamw: --optimizer for both programs (--lr's default follows it)
DP=${DP:-2}                            # pipeline_dp_joint.py, parallel_3d.py: data-parallel replicas
TP=${TP:-2}                            # parallel_3d.py: tensor-parallel ranks per stage
ZERO=${ZERO:-0}                        # pipeline_dp_joint.py, parallel_3d.py: 1 = ZeRO-1, 2 = ZeRO-2, 3 = ZeRO-3 (--zero, docs/optimizers.md)
MODEL=${MODEL:-cnn}                    # cnn | mlp | vit
STEPS=${STEPS:-300}
DATA=${DATA:-auto}                     # auto | cifar10 | synthetic
BACKEND=${BACKEND:-auto}               # auto | gloo | nccl
BATCH_SIZE=${BATCH_SIZE:-64}
SEED=${SEED:-0}
EVAL_EVERY=${EVAL_EVERY:-50}
LOGS=${LOGS:-logs}
PLOTS=${PLOTS:-$LOGS/plots}
PYTHON=${PYTHON:-python}
RDZV_HOST=${RDZV_HOST:-}               # the rendezvous address; default: the first node's, from Slurm
RDZV_PORT=${RDZV_PORT:-}               # default: 29500 + (job id mod 1000), so two jobs on one node differ
CHECKPOINT_DIR=${CHECKPOINT_DIR:-}     # set: passed as --checkpoint-dir, so a requeued job resumes
SAVE_EVERY=${SAVE_EVERY:-}             # set: passed as --save-every (steps between checkpoints)

fail() { echo "error: $*" >&2; exit 2; }

# ---- 1. are we inside a Slurm job? ------------------------------------------------------------
# sbatch (and salloc) describe the allocation in SLURM_* variables: the job id, the node names,
# how many nodes. Run directly on a login node, none of them is set.
if [ -z "${SLURM_JOB_ID:-}" ] || [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    fail "run_slurm.sh runs inside a Slurm job, and SLURM_JOB_ID is not set: submit it with" \
         "'sbatch run_slurm.sh', or run 'salloc -N 2 bash run_slurm.sh'; on one machine use run_pipeline.sh"
fi
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?}}

case "$ACTIVATION" in
    gelu|relu) ;;
    *) fail "ACTIVATION=$ACTIVATION is not an activation here: set ACTIVATION=gelu or ACTIVATION=relu" ;;
esac
case "$OPTIMIZER" in
    sgd|adamw) ;;
    *) fail "OPTIMIZER=$OPTIMIZER is not an optimizer here: set OPTIMIZER=sgd or OPTIMIZER=adamw" ;;
esac
case "$PROGRAM" in
    pipeline_microbatch.py) PARALLEL=(--schedule "$SCHEDULE" --microbatches "$MICROBATCHES") ;;
    pipeline_dp_joint.py)   PARALLEL=(--dp "$DP" --schedule "$SCHEDULE" --microbatches "$MICROBATCHES") ;;
    tensor_parallel.py)     PARALLEL=() ;;
    parallel_3d.py)         PARALLEL=(--dp "$DP" --tp "$TP" --schedule "$SCHEDULE" --microbatches "$MICROBATCHES") ;;
    *) fail "PROGRAM=$PROGRAM is not one of the parallel programs: set PROGRAM to pipeline_microbatch.py," \
            "pipeline_dp_joint.py, tensor_parallel.py or parallel_3d.py" ;;
esac
if [ "$ZERO" != 0 ]; then   # ZeRO-1 splits the optimizer state over data-parallel replicas: those programs only
    case "$PROGRAM" in
        pipeline_dp_joint.py|parallel_3d.py) PARALLEL+=(--zero "$ZERO") ;;
        *) fail "ZERO=$ZERO splits the optimizer state over data-parallel replicas, and $PROGRAM has none:" \
                "unset ZERO, or set PROGRAM to pipeline_dp_joint.py or parallel_3d.py" ;;
    esac
fi
case "$NPROC" in
    ''|*[!0-9]*|0) fail "NPROC=$NPROC must be a positive integer: the ranks per node (e.g. its GPUs)" ;;
esac
if [ -n "$BALANCE" ]; then   # the stages' split: the pipeline programs only (the baseline is one stage)
    [ "$PROGRAM" != tensor_parallel.py ] || fail "BALANCE=$BALANCE splits pipeline stages, and" \
        "tensor_parallel.py has none: unset BALANCE, or set PROGRAM to a pipeline program"
    PARALLEL+=(--balance "$BALANCE")
fi
# PipeDream-2BW trains by another rule (each gradient one update stale): its reference is the
# baseline with --delay 1, the same rule in one process (docs/pipeline.md). The other programs
# refuse --schedule 2bw in the check of step 4.
DELAY=()
if [ "$SCHEDULE" = 2bw ] && [ "$PROGRAM" = pipeline_microbatch.py ]; then DELAY=(--delay 1); fi

# ---- 2. find the repository --------------------------------------------------------------------
# sbatch runs a copy of this script from Slurm's spool directory, so $0 does not lead back to the
# repository; the directory the job was submitted from (SLURM_SUBMIT_DIR) does.
if [ -z "${REPO:-}" ]; then
    for dir in "$(dirname "$0")" "${SLURM_SUBMIT_DIR:-}"; do
        if [ -n "$dir" ] && [ -f "$dir/single_baseline.py" ]; then REPO=$dir; break; fi
    done
fi
if [ -z "${REPO:-}" ] || [ ! -f "$REPO/$PROGRAM" ]; then
    fail "cannot find $PROGRAM (REPO=${REPO:-unset}, submitted from ${SLURM_SUBMIT_DIR:-?}): submit the job" \
         "from the repository's root ('cd model-parallel && sbatch run_slurm.sh'), or set REPO=/path/to/it"
fi
cd "$REPO"
# a set variable that is another launcher's knob, or one typo away from one of these: refused
"$PYTHON" -m mp.tools.knobs run_slurm.sh || exit $?
mkdir -p "$LOGS" "$PLOTS"

# ---- 3. the rendezvous: the first node's address and a port ------------------------------------
# SLURM_JOB_NODELIST is compressed ("n[1-2]"); `scontrol show hostnames` expands it. The node's
# name need not resolve through DNS, so ask the controller for the address it reaches the node at
# (NodeAddr), which is what the other nodes can reach too.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
if [ -z "$RDZV_HOST" ]; then
    RDZV_HOST=$(scontrol show node "$HEAD_NODE" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)
fi
[ -n "$RDZV_HOST" ] || fail "Slurm gave no NodeAddr for node $HEAD_NODE: set RDZV_HOST to its address"
RDZV_PORT=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}

WORLD=$((NNODES * NPROC))
NAME=${PROGRAM%.py}
COMMON=(--model "$MODEL" --steps "$STEPS" --data "$DATA" --batch-size "$BATCH_SIZE" --seed "$SEED"
        --eval-every "$EVAL_EVERY" --activation "$ACTIVATION" --optimizer "$OPTIMIZER" "$@")
# Checkpoints come from the program (torch.distributed.checkpoint): a requeued job starts this
# script again, and the program finds its last checkpoint in CHECKPOINT_DIR and goes on from there.
# A program without --checkpoint-dir refuses the flag in the check below, before anything trains.
if [ -n "$CHECKPOINT_DIR" ]; then PARALLEL+=(--checkpoint-dir "$CHECKPOINT_DIR"); fi
if [ -n "$SAVE_EVERY" ]; then PARALLEL+=(--save-every "$SAVE_EVERY"); fi
# the job id names the logs: a requeued job keeps its id, and so its log
LOG="$LOGS/slurm-${SLURM_JOB_ID}-${NAME}_${MODEL}_n${NNODES}x${NPROC}.jsonl"
BASELINE_LOG="$LOGS/slurm-${SLURM_JOB_ID}-single_baseline_${MODEL}${DELAY:+_delay1}.jsonl"

# ---- 4. check the arguments at the job's world size, before anything trains --------------------
# (the program's own parse_args under WORLD_SIZE, as torchrun would set it; it trains nothing)
WORLD_SIZE=$WORLD "$PYTHON" -c "import sys, $NAME as p; p.parse_args(sys.argv[1:])" \
    "${COMMON[@]}" --backend "$BACKEND" "${PARALLEL[@]}" --log-file "$LOG"

# ---- 5. the baseline: one process on this node (the job's first node, where sbatch runs this) --
# A requeued job (SLURM_RESTART_COUNT > 0) whose baseline finished before the requeue keeps it: a log
# takes its final name only once its run is complete (mp/log.py), and the job id in the name means
# this job's settings, so running it again would write the same file.
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -f "$BASELINE_LOG" ]; then
    echo "== baseline: finished before the requeue, not run again ($BASELINE_LOG)"
else
    echo "== baseline${DELAY:+ with --delay 1, the 2bw reference}: one process on $(hostname)"
    "$PYTHON" single_baseline.py "${COMMON[@]}" "${DELAY[@]}" --log-file "$BASELINE_LOG"
fi

# ---- 6. the parallel run: srun starts one torchrun agent per node ------------------------------
# srun runs its command once per task: here one task on each of the job's nodes. Every agent is
# told the same rendezvous (c10d: a key-value store that the agent on the first node serves at
# RDZV_HOST:RDZV_PORT) and the job id as the rendezvous id; they wait there until all NNODES have
# joined, agree on RANK/WORLD_SIZE for every process, and start NPROC ranks each. No --node-rank
# is needed: the rendezvous hands them out. --kill-on-bad-exit ends the other nodes' agents when one
# fails; --label prefixes each output line with the node's task number (0: first node).
echo "== $NAME: $NNODES nodes x $NPROC ranks = $WORLD ranks; rendezvous $RDZV_HOST:$RDZV_PORT ($HEAD_NODE)"
srun --nodes "$NNODES" --ntasks "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 --label \
    ${SLURM_CPUS_PER_TASK:+--cpus-per-task "$SLURM_CPUS_PER_TASK"} \
    "$PYTHON" -m mp.tools.torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
        --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" -- \
        "$PROGRAM" "${COMMON[@]}" --backend "$BACKEND" "${PARALLEL[@]}" --log-file "$LOG"

# ---- 7. the plot ------------------------------------------------------------------------------
PLOT="$PLOTS/slurm-${SLURM_JOB_ID}-${NAME}_${MODEL}_loss.png"
CONTRACT=0   # 1: a run broke the equivalence contract; the figure is drawn and its line is on stderr
"$PYTHON" -m mp.tools.plot_curves "$BASELINE_LOG" "$LOG" -o "$PLOT" || CONTRACT=$?
if [ "$CONTRACT" != 0 ] && [ "$CONTRACT" != 1 ]; then exit "$CONTRACT"; fi
echo "wrote:"
printf '  %s\n' "$BASELINE_LOG" "$LOG" "$PLOT"
exit "$CONTRACT"
