# What every run_*.sh launcher shares, sourced by each once it has changed into the repository: its
# knobs, the checks it makes before anything trains, the names of its files and its exits. The
# launcher declares its knobs with `knob`, sets KNOBS, its flags that have a knob, as flag:KNOB:kind
# (kind n: a number, w: a word, -: no value). Every mistake is one `error:` line on stderr, in the
# launcher's own terms (MICROBATCHES=3, not --microbatches 3), then exit status 2.

launcher_error() {
    echo "error: $*" >&2
    exit 2
}

# ---- exits ---------------------------------------------------------------------------------------
# A failed step stops the launcher with its name (STEP), before anything later is plotted. A step
# that was interrupted (Ctrl-C reaches every process of the job; torchrun passes it to the ranks)
# has said so in one line and exits 130: the launcher then leaves with the same status, naming only the
# files its runs had finished (launcher_interrupted: they stay in the run's folder). The INT trap is there
# for a Ctrl-C that lands just as a step ends well (exit 0), which bash would otherwise take for a step
# that handled the signal, and run on to the end (seen in CI).
launcher_stopped() {   # the ERR trap: RC
    if [ "$1" = 130 ]; then launcher_interrupted; fi
    local kept=""
    if [ -n "${RUN_STAGE:-}" ] && [ -d "$RUN_STAGE" ]; then
        kept="; its files so far are in $RUN_STAGE, the earlier run's untouched"
    fi
    echo "$(basename "$0"): stopped: $STEP failed with exit status $1; nothing after it ran$kept" >&2
}
trap 'launcher_stopped $?' ERR
trap 'launcher_interrupted' INT

launcher_interrupted() {   # exit 130; the files the runs finished before the Ctrl-C stay in the run's folder
    # (moved only when every run has finished): named, since the console said they would move
    local parked=()
    if [ -n "${RUN_STAGE:-}" ] && [ -d "$RUN_STAGE" ]; then
        mapfile -t parked < <(find "$RUN_STAGE/logs" "$RUN_STAGE/plots" -type f ! -name '*.partial-*' 2>/dev/null |
                              sort)
    fi
    if [ ${#parked[@]} -gt 0 ]; then
        parked=("${parked[@]#"$RUN_STAGE/"}")
        echo "note: interrupted, so the finished ${parked[*]} stayed in $RUN_STAGE, not moved to $FINAL_LOGS:" \
            "the same command again finishes the run (and moves the files), or delete the folder" >&2
    fi
    exit 130
}

# ---- starting python -----------------------------------------------------------------------------
# Every python the launcher runs starts with SIGINT blocked. A Ctrl-C that lands while the interpreter
# starts (importing `site`, before any line of ours) would otherwise raise KeyboardInterrupt there:
# "Fatal Python error: init_import_site" and a traceback, which no handler of ours can prevent. Blocked,
# the Ctrl-C waits, pending, until the program's first lines have put its handler in place and unblock
# it (mp/errors.py stop_on_interrupt): then one line and exit 130, as at any later moment. Blocked, not
# ignored: an ignored Ctrl-C would be lost, and the step would run on to its end. The blocked mask
# outlives exec: GNU env (coreutils 8.31 or later) sets it, else perl; with neither, python starts
# unguarded (a Ctrl-C in its first milliseconds may print python's own error). A python that never
# unblocks (a -c one-liner) runs to its end, and the INT trap then stops the script.
if env --block-signal=INT true 2>/dev/null; then
    BLOCK_SIGINT=(env --block-signal=INT)
elif command -v perl >/dev/null 2>&1; then
    BLOCK_SIGINT=(perl -MPOSIX -e 'sigprocmask(SIG_BLOCK, POSIX::SigSet->new(SIGINT));'
                       -e 'exec { $ARGV[0] } @ARGV or exit 127')
else
    BLOCK_SIGINT=()
fi
run_python() {   # ARGS...: "$PYTHON" ARGS..., started with SIGINT blocked; its status is the call's
    # MP_LAUNCHER_PID: the python ends if this launcher is killed, and torchrun's agent stops its ranks
    # (mp/errors.py end_with_launcher): no rank outlives the launcher
    if [ -z "${RUN_STAGE:-}" ]; then   # (the caller's ERR trap names the failed STEP)
        MP_LAUNCHER_PID=$$ "${BLOCK_SIGINT[@]}" "$PYTHON" "$@" || return $?
    else   # once the run writes into its own folder: its lines name files as they will be (pipefail: python's status)
        MP_LAUNCHER_PID=$$ "${BLOCK_SIGINT[@]}" "$PYTHON" "$@" | unstaged || return $?
    fi
}

unstaged() {   # stdin to stdout; a program's `wrote FILE` of a file in RUN_STAGE names where the file will go:
               # the folder is gone once the launcher ends, and its last lines name every file it wrote
    trap '' INT    # a Ctrl-C is the program's to report: read on until it has said its line and ended
    local line file
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in
            "wrote $RUN_STAGE/"*)
                file=${line#wrote } && file=${file%%: *}
                say_staged_once
                if [[ $line == *": "* ]]; then echo "$(basename "$file"): ${line#*: }"; fi ;;   # the timeline's bubble
            *) printf '%s\n' "$line" ;;
        esac
    done
}

say_staged_once() {   # one line a launch, at its first finished file, in place of one line a file
    if [ ! -e "$RUN_STAGE/said-staged" ]; then
        : > "$RUN_STAGE/said-staged"
        echo "finished: the runs' files move together to $FINAL_LOGS (figures: $FINAL_PLOTS) when the launcher" \
            "ends; its last lines name them"
    fi
}

# ---- --help --------------------------------------------------------------------------------------
# `bash run_X.sh --help` (or -h) prints the launcher's own usage at once and exits 0: its header
# (what it runs, examples), every knob with its default and meaning, read from the knob lines of the
# launcher and of this file, and where the files go. Nothing else runs: no python, no training.
launcher_usage() {
    local me knobs
    me=$(basename "$0")
    echo "usage: [KNOB=value ...] bash $me [flags for both programs, e.g. --layers 6]"
    echo
    sed -n '2,/^set -euo pipefail/p' "$0" | sed -e '/^set -euo pipefail/d' -e 's/^# \{0,1\}//'
    echo
    echo "Knobs (environment variables), default and meaning:"
    knobs=$(grep -hE '^ *knob [A-Z_]+ ' "$0" "${BASH_SOURCE[0]}")
    echo "$knobs" | sed -E 's/^ *knob ([A-Z_]+) "([^"]*)" *(# *)?(.*)$/\1\t"\2"\t\4/' |
        awk -F'\t' '{ printf "  %-15s %-18s %s\n", $1, $2, $3 }'
    echo
    echo "Writes the baseline's and each parallel run's log under \$LOGS (default logs/) and the figures under"
    echo "\$PLOTS (default logs/plots/), every setting off its default in their names; its last lines name them."
    echo "Each program lists its own flags: python <program>.py --help."
}
LAUNCH_ARGS="$*"   # the extra flags, as typed: the run's folder records the command (start_stage)
for arg in "$@"; do
    case "$arg" in
        -h | --help) launcher_usage; exit 0 ;;
    esac
done

# ---- knobs ---------------------------------------------------------------------------------------
declare -A KNOB_DEFAULT=()
knob() {   # NAME DEFAULT: NAME from the environment (when set and not empty), else DEFAULT
    KNOB_DEFAULT[$1]=$2
    if [ -z "${!1:-}" ]; then printf -v "$1" '%s' "$2"; fi
}

shared_knobs() {   # the knobs every run_*.sh has, with the same defaults
    knob SEED "0"
    knob EVAL_EVERY "50"
    knob ACTIVATION "gelu"                 # gelu | relu: every model's activation, both programs (relu: the course's)
    knob DROPOUT "0"                       # dropout probability, both programs (keyed masks: exact in every layout)
    knob CLIP ""                           # clip the gradient to this global norm, both programs (empty: off)
    knob OPTIMIZER "sgd"                   # sgd | adamw: --optimizer for both programs (--lr's default follows it)
    knob CHECKPOINT_DIR ""                 # the parallel run saves checkpoints under it and resumes from the latest
    knob SAVE_EVERY "50"                   # with CHECKPOINT_DIR: save every K steps and after the last
    knob RESTARTS "0"                      # torchrun --max-restarts: a killed rank restarts the workers, which resume
    knob CHECK_ONLY "0"                    # 1: check the knobs and every run's arguments, then stop (nothing trains)
    knob LOGS "logs"
    knob PLOTS "$LOGS/plots"               # PLOTS=plots rewrites the committed figures (docs/running.md)
    knob PYTHON "python"
    # a relative LOGS or PLOTS is the repository's folder, where the launcher runs (it changed into it);
    # run from elsewhere (bash ~/mp/run_tp.sh), every path it and the programs print is absolute, so
    # that each opens from where the user stands
    if [ "$OLDPWD" != "$PWD" ]; then
        case "$LOGS" in /*) ;; *) LOGS="$PWD/$LOGS" ;; esac
        case "$PLOTS" in /*) ;; *) PLOTS="$PWD/$PLOTS" ;; esac
    fi
}

require_python() {   # before anything else: PYTHON must be an interpreter that has torch
    if ! run_python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
            >/dev/null 2>&1; then
        launcher_error "PYTHON=$PYTHON cannot import torch: set up once with 'python3 -m venv .venv &&" \
            "source .venv/bin/activate && pip install -r requirements.txt' (the README's install line), or in a" \
            "new shell run 'source .venv/bin/activate', then run bash $(basename "$0") again"
    fi
}

check_environment() {   # a set variable that is another launcher's knob or one typo away from a knob
    run_python -m mp.tools.knobs "$(basename "$0")" || exit $?
}

# ---- names ---------------------------------------------------------------------------------------
# Every run keeps its own files: the settings that shape a curve are in its name, so a run never
# replaces another's; a run at the launcher's defaults keeps the names the README gives.
settings_tag() {   # KNOB...: for each of these knobs not at its default, _value (a word: _vit, _synthetic,
                   # _zb) or _knobvalue (a number: _steps100, _nproc2; SCHEDULE="1f1b zb": _1f1b-zb)
    local tag="" name value
    for name in "$@"; do
        value=${!name}
        if [ "$value" != "${KNOB_DEFAULT[$name]}" ]; then
            case "$name" in
                MODEL | DATA | SCHEDULE | ACTIVATION | BACKEND | OPTIMIZER) tag+="_${value// /-}" ;;
                *) name=${name,,} && tag+="_${name//_/}${value// /-}" ;;
            esac
        fi
    done
    echo "${tag//[^A-Za-z0-9._=-]/}"
}

# ---- one run, one set of files -------------------------------------------------------------------
# A run writes every file (logs, timelines, figures) into a folder of its own, RUN_STAGE under
# $LOGS/.unfinished/, and moves them to their names only once the last has been written
# (say_written): interrupted or failed at any moment, the earlier run's set stays whole, never half
# replaced, and this run's files so far stay in RUN_STAGE. The folder is named by the launcher and
# the settings that shape the run, so a rerun of the same settings finds there what an interrupted
# one left (a checkpointed run resumes its partial log from it) and clears it when it ends.
stage_outputs() {   # after the knobs and COMMON: LOGS and PLOTS point into RUN_STAGE; FINAL_LOGS, FINAL_PLOTS
    FINAL_LOGS=$LOGS FINAL_PLOTS=$PLOTS
    local key name
    key=$( { basename "$0"; printf '%s\n' "${COMMON[@]}"   # what the run trains, not where or with which python
             for name in "${!KNOB_DEFAULT[@]}"; do
                 case "$name" in PYTHON | LOGS | PLOTS | CHECK_ONLY) ;; *) echo "$name=${!name}" ;; esac
             done | sort; } | cksum | cut -d' ' -f1)
    RUN_STAGE="$FINAL_LOGS/.unfinished/$(basename "$0" .sh)-$key"
    LOGS="$RUN_STAGE/logs" PLOTS="$RUN_STAGE/plots"
}

start_stage() {   # after the checks: the run's folder, and the command that made it (a later run names it)
    mkdir -p "$LOGS" "$PLOTS"
    local name settings=()
    for name in $(printf '%s\n' "${!KNOB_DEFAULT[@]}" | sort); do
        case "$name" in PYTHON | LOGS | PLOTS | CHECK_ONLY) continue ;; esac
        if [ "${!name}" = "${KNOB_DEFAULT[$name]}" ]; then continue; fi
        case "${!name}" in *" "*) settings+=("$name=\"${!name}\"") ;; *) settings+=("$name=${!name}") ;; esac
    done
    echo "${settings[*]}${settings[*]:+ }bash $(basename "$0")${LAUNCH_ARGS:+ $LAUNCH_ARGS}" > "$RUN_STAGE/command"
    echo "$$" > "$RUN_STAGE/pid"       # while this launcher lives, another does not call its folder unfinished
}

final_name() {   # FILE: where a file of RUN_STAGE goes when the run ends
    case "$1" in
        "$RUN_STAGE/logs/"*) echo "$FINAL_LOGS/${1#"$RUN_STAGE/logs/"}" ;;
        "$RUN_STAGE/plots/"*) echo "$FINAL_PLOTS/${1#"$RUN_STAGE/plots/"}" ;;
        *) echo "$1" ;;
    esac
}

say_written() {   # FILE...: this run's files moved from RUN_STAGE to their names, as one set; the launcher's
                  # last lines say which earlier files they replaced and what this run wrote
    local file replaced=() finals=()
    for file in "$@"; do
        finals+=("$(final_name "$file")")
        if [ -e "${finals[-1]}" ]; then replaced+=("${finals[-1]}"); fi
    done
    trap '' INT                     # a few renames: a Ctrl-C now would leave the set half moved
    for file in "$@"; do
        mkdir -p "$(dirname "$(final_name "$file")")"
        mv -f "$file" "$(final_name "$file")"
    done
    rm -rf "${RUN_STAGE:?}"          # what is left there is superseded: this run's partial logs, an earlier attempt's
    rmdir "$FINAL_LOGS/.unfinished" 2>/dev/null || true
    trap 'launcher_interrupted' INT
    if [ ${#replaced[@]} -gt 0 ]; then (IFS=,; echo "replaced the earlier run's files: ${replaced[*]}" | sed 's/,/, /g'); fi
    left_unfinished
    echo "wrote:"
    printf '  %s\n' "${finals[@]}"
    say_what_holds
}

left_unfinished() {   # what earlier runs of this launcher with other settings left in .unfinished/, named with
                      # the command that made each: not cleared, since one may be running now or resume from it
    local stage pid
    for stage in "$FINAL_LOGS/.unfinished/$(basename "$0" .sh)"-*/; do
        pid=$(cat "$stage/pid" 2>/dev/null || true)
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then continue; fi   # still running: another launch's
        if [ -d "$stage" ]; then
            echo "note: an earlier run of $(basename "$0") that did not finish left ${stage%/} ($(cat "$stage/command" \
                2>/dev/null || echo "its settings unrecorded")): run that again to finish it, or delete the folder"
        fi
    done
}

# ---- what holds ----------------------------------------------------------------------------------
# mp.tools.plot_curves says for each parallel run what the equivalence contract found (within 1e-4
# at every step, or exact until the routing first differs); plot_logs keeps those lines so the
# launcher ends with them, after the files. A run that breaks the contract is drawn, its files are
# moved into place like any run's, and the launcher's last line names it and the step, exit status 1.
VERDICTS=() BREACHES=()
plot_logs() {   # ARGS...: python -m mp.tools.plot_curves ARGS...
    local out errors rc=0
    errors=$(mktemp)
    out=$(run_python -m mp.tools.plot_curves "$@" 2>"$errors") || rc=$?
    cat "$errors" >&2
    if [ -n "$out" ]; then printf '%s\n' "$out" | grep -vE '^(largest |not comparable)' || true; fi   # said last
    mapfile -t -O "${#VERDICTS[@]}" VERDICTS < <(printf '%s\n' "$out" | grep -E '^(largest |not comparable)' || true)
    mapfile -t -O "${#BREACHES[@]}" BREACHES < <(grep '^contract broken: ' "$errors" || true)
    rm -f "$errors"
    if [ "$rc" != 0 ] && { [ "$rc" != 1 ] || [ ${#BREACHES[@]} = 0 ]; }; then return "$rc"; fi
}

say_what_holds() {   # the launcher's last lines: what the contract found; a breach on stderr, exit status 1
    if [ ${#VERDICTS[@]} -gt 0 ]; then printf '%s\n' "${VERDICTS[@]}"; fi
    if [ ${#BREACHES[@]} -gt 0 ]; then
        printf '%s\n' "${BREACHES[@]}" >&2
        exit 1
    fi
}

check_knob() {   # NAME VALUE ALLOWED...: a knob with a few legal values
    local name=$1 value=$2 ok
    shift 2
    for ok in "$@"; do
        if [ "$value" = "$ok" ]; then return 0; fi
    done
    launcher_error "$name=$value must be one of: $*"
}

check_count() {   # NAME VALUE: a positive integer such as NPROC
    case "$2" in
        '' | *[!0-9]* | 0*) launcher_error "$1=$2 must be a positive integer" ;;
    esac
}

refuse_knob_flags() {   # the extra arguments: a flag that has a knob is refused, with the knob to set
    local args=("$@") i pair flag knob kind typed value program
    for ((i = 0; i < ${#args[@]}; i++)); do
        typed=${args[i]%%=*}
        case "$typed" in --???*) ;; *) continue ;; esac
        if [ "$typed" = --check ]; then   # the programs' own --check, not an abbreviated --checkpoint-dir
            case "$(basename "$0")" in
                run_pipeline.sh) program=pipeline_microbatch.py ;; run_joint.sh) program=pipeline_dp_joint.py ;;
                run_tp.sh) program=tensor_parallel.py ;; run_cp.sh) program=context_parallel.py ;;
                run_ep.sh) program=expert_parallel.py ;;
                *) program=parallel_3d.py ;;
            esac
            launcher_error "--check compares one step with the full model and trains nothing: run the program itself, e.g. torchrun --standalone --nproc-per-node $NPROC -- $program --data ${DATA:-auto} --check (the launcher trains and plots)"
        fi
        for pair in "${KNOBS[@]}"; do
            IFS=: read -r flag knob kind <<< "$pair"
            case "$flag" in "$typed"*) ;; *) continue ;; esac   # argparse takes a prefix as the flag too
            if [ "$kind" = - ]; then
                value=$knob
                if [ "$knob" = LOGS ]; then value="LOGS=DIR (the launcher names the files in it)"; fi
            elif [[ ${args[i]} == *=* ]]; then
                value="$knob=${args[i]#*=}"
            else
                value="$knob=${args[i + 1]:-...}"
            fi
            launcher_error "$(basename "$0") sets $flag from a knob: use $value bash $(basename "$0"), not ${args[i]} (extra flags reach the baseline too, and the knobs name the logs and the plots)"
        done
    done
}

trains_models() {   # WHY MODELS ARGS...: a launcher whose lesson runs only MODELS ("vit gpt"): MODEL or an extra
                    # --model naming another model says what the lesson runs and where that model is trained,
                    # not a refusal in terms of the knobs it set for its own models (EXPERTS, TOP_K)
    local why=$1 models=$2 args i model asked=("$MODEL")
    shift 2
    args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
        case "${args[i]}" in
            --model=*) asked+=("${args[i]#--model=}") ;;
            --model) asked+=("${args[i + 1]:-}") ;;
        esac
    done
    for model in "${asked[@]}"; do
        if [[ " $models " != *" $model "* ]]; then
            launcher_error "$(basename "$0") trains the ${models// / or the }, $why; drop --model $model" \
                "(MODEL=$model), or train the $model with another launcher: MODEL=$model bash run_3d.sh" \
                "(or run_pipeline.sh, run_joint.sh, run_tp.sh)"
        fi
    done
}

in_knob_terms() {   # stdin to stdout with the programs' flags as the knobs: --microbatches 3 -> MICROBATCHES=3
    # a flag only where it stands alone: --experts, not the tail of a --num-experts the user typed
    local script=() pair flag knob kind end='\([^a-z-]\|$\)' start='\(^\|[^a-z-]\)'
    for pair in "${KNOBS[@]}"; do
        IFS=: read -r flag knob kind <<< "$pair"
        case "$kind" in
            n) script+=(-e "s/$start$flag \([0-9-][^ ,;:)]*\)/\1$knob=\2/g" -e "s/$start$flag$end/\1$knob\2/g") ;;
            w) script+=(-e "s/$start$flag \([a-z0-9][^ ,;:)]*\)/\1$knob=\2/g" -e "s/$start$flag$end/\1$knob\2/g") ;;
            -) if [[ $knob == *=* ]]; then script+=(-e "s/$start$flag$end/\1$knob\2/g"); fi ;;
        esac
    done
    sed "${script[@]}" -e 's/world size \([0-9][0-9]*\)/world size NPROC=\1/g' \
        -e 's/tensor-parallel degree \([0-9][0-9]*\)/tensor-parallel degree NPROC=\1/g' \
        -e 's/context-parallel degree \([0-9][0-9]*\)/context-parallel degree NPROC=\1/g' \
        -e 's/torchrun --nproc-per-node \([0-9][0-9]*\)/NPROC=\1/g'
}

# The runs' arguments are checked all at once, before anything trains: check_args and
# check_baseline_args queue a run, run_checks checks the queue in one python that does not import
# torch (mp/tools/check_args.py: each program's parser and checks from mp/cli.py, at the world size
# its ranks will have), so a refused setting answers in a fraction of a second.
CHECKS=()
check_args() {   # PROGRAM ARGS...: queue the parallel program's flags, to be checked at WORLD_SIZE=$NPROC
    CHECKS+=(:: "$NPROC" "$@")
}

check_baseline_args() {   # ARGS...: queue the baseline's flags (it takes the extra flags too)
    CHECKS+=(:: 1 single_baseline "$@")
}

run_checks() {   # the queued runs' flags; the first refused prints its one error line, in the knobs' terms
    local err rc=0
    { err=$(run_python -m mp.tools.check_args --launcher "$(basename "$0")" --knobs "${KNOBS[*]}" \
                "${CHECKS[@]:1}" 2>&1 1>&3) || rc=$?; } 3>&1
    if [ "$rc" != 0 ]; then
        printf '%s\n' "$err" | in_knob_terms >&2   # the program's one error line: nothing has trained
        exit "$rc"
    fi
    if [ -n "$err" ]; then printf '%s\n' "$err" >&2; fi
    export MP_CORES_NOTED=1   # more ranks than cores: check_args said so once; each torchrun after it stays quiet
    if [ "$CHECK_ONLY" = 1 ]; then
        local runs=0 arg
        for arg in "${CHECKS[@]}"; do if [ "$arg" = :: ]; then runs=$((runs + 1)); fi; done
        echo "CHECK_ONLY=1: the knobs and the arguments of the $runs runs (the baseline's included) are good; nothing trained"
        exit 0
    fi
}

flags_tag() {   # the extra flags that change what runs, as part of a file name: --layers 6 -> _layers6
    local tag="" skip=0 arg
    for arg in "$@"; do
        if [ "$skip" = 1 ]; then skip=0; continue; fi
        case "$arg" in
            --data-dir | --threads | --timeout-s) skip=1 ;;
            --data-dir=* | --threads=* | --timeout-s=*) ;;
            --*) tag+="_${arg#--}" ;;
            *) tag+="$arg" ;;
        esac
    done
    echo "${tag//[^A-Za-z0-9._=-]/}"
}

run_knobs() {   # after COMMON and EXTRA: ACTIVATION, OPTIMIZER, DROPOUT and CLIP go to both programs and into
                # the log names; RESTARTS to torchrun (TORCHRUN_OPTS); CHECKPOINT_DIR is the parallel run's (checkpoint_flags)
    check_knob ACTIVATION "$ACTIVATION" gelu relu
    check_knob CHECK_ONLY "$CHECK_ONLY" 0 1
    check_knob OPTIMIZER "$OPTIMIZER" sgd adamw
    case "$RESTARTS" in '' | *[!0-9]*) launcher_error "RESTARTS=$RESTARTS must be 0 or a positive integer" ;; esac
    if [ -n "$CHECKPOINT_DIR" ]; then check_count SAVE_EVERY "$SAVE_EVERY"; fi
    if [ "$ACTIVATION" != gelu ]; then COMMON+=(--activation "$ACTIVATION"); fi
    COMMON+=(--optimizer "$OPTIMIZER")
    if [ "$DROPOUT" != 0 ]; then COMMON+=(--dropout "$DROPOUT"); fi
    if [ -n "$CLIP" ]; then COMMON+=(--clip-grad-norm "$CLIP"); fi
    # what shapes both runs' curves, in the names (at their defaults, the names runs had before the knobs)
    EXTRA+=$(settings_tag ACTIVATION OPTIMIZER STEPS SEED DATA EVAL_EVERY DROPOUT CLIP)
    TORCHRUN_OPTS=(--max-restarts "$RESTARTS")
    stage_outputs                      # every file this run writes goes to RUN_STAGE until its end
}

balance_knob() {   # BALANCE: --balance for the pipeline program only (the baseline is one stage), and its
                   # tag for the log and plot names: BALANCE_FLAGS, BALANCE_TAG (auto -> _balanceauto)
    BALANCE_FLAGS=() BALANCE_TAG=""
    if [ -n "${BALANCE:-}" ]; then
        BALANCE_FLAGS=(--balance "$BALANCE") BALANCE_TAG="_balance${BALANCE//[^A-Za-z0-9]/-}"
    fi
}

zero_knob() {   # ZERO (run_joint.sh, run_3d.sh): --zero for the parallel program only (the baseline has no
                # replicas), and its tag for the log and plot names: ZERO_FLAGS, ZERO_TAG (1 -> _zero1)
    check_knob ZERO "$ZERO" 0 1 2 3
    ZERO_FLAGS=(--zero "$ZERO") ZERO_TAG=$(settings_tag ZERO)
}

checkpoint_flags() {   # LOG: the parallel run's checkpoints, in a directory of its own under CHECKPOINT_DIR
    CKPT=()            # (one per run: two schedules must not resume from each other's checkpoints)
    if [ -n "$CHECKPOINT_DIR" ]; then
        CKPT=(--checkpoint-dir "$CHECKPOINT_DIR/$(basename "$1" .jsonl)" --save-every "$SAVE_EVERY")
        # a run that resumes takes its earlier steps' records from its log: the finished one, if
        # RUN_STAGE holds no partial of an interrupted attempt
        local final; final=$(final_name "$1")
        if [ -e "$final" ] && ! compgen -G "${1%.jsonl}*.jsonl" >/dev/null; then
            mkdir -p "$(dirname "$1")" && cp -p "$final" "$1"
        fi
    fi
}
