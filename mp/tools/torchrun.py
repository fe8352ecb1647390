"""torchrun as the launchers run it: `python -m mp.tools.torchrun ARGS` is `torchrun ARGS`, the same
agent, options and ranks, with torchrun's own output cut to what the user needs.

When a rank fails, torchrun prints its log lines and a report of 40-55 lines (its own traceback, then
a table naming the rank and exit code) after the one line in which our program already said what
went wrong (`error: ...`, exit status 2) or that it was interrupted (Ctrl-C, exit status 130). Here
torchrun's logging is silenced and its final exception is caught: a rank that said something leaves
it as the last word, a rank that died without a word (killed by a signal) gets one `error:` line
naming it, and the exit status is the failed rank's own (2, 130, ...), not torchrun's 1.

    python -m mp.tools.torchrun --standalone --nproc-per-node 4 -- pipeline_microbatch.py --steps 10

On a machine without a GPU the ranks are forked from this agent rather than started as new pythons.
Each new python imported torch (about 2 s of CPU) and, at its first optimizer, torch._dynamo (about
1.2 s): on 2 cores a short 4-rank run spent more time starting than training. Here the agent imports
both once, then runs `torchrun --run-path --start-method fork mp/tools/forked_rank.py SCRIPT ARGS`,
torchrun's own way to fork ranks from itself; forked_rank.py makes each rank look like a new python
(its docstring says how, and what two processes a rank are for). With a GPU, or when the ranks are not
`python SCRIPT` (--no-python, -m, PYTHON_EXEC), or with MP_TORCHRUN_FORK=0, the ranks are new pythons
as before: CUDA must not be touched before a fork, and a fork is not tried where nothing tests it.
"""
from mp.errors import LAUNCHER_PID, note_shared_cores, say_when_interrupted, stop_on_interrupt
if __name__ == "__main__":   # Ctrl-C while torch is imported (seconds): one line, exit 130; no rank has started
    say_when_interrupted(lambda: "interrupted while torchrun started: no rank had started")
    stop_on_interrupt()      # (torchrun's agent puts its own handler in place when it starts the ranks)

import logging
import os
import signal
import sys

import torch
import torch.distributed.run as torchrun
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from mp.tools import forked_rank

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAID_IT = (1, 2, 130)   # our programs' exit statuses, each after its own line (1: a communication failure)


def quiet_torchrun():
    """torchrun's agent logs through one logger per module, each with its own level."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run",
                            "torch.multiprocessing")):   # forked ranks: "Terminating process ..." when one fails
            logging.getLogger(name).setLevel(logging.CRITICAL)


def status_of(failure):
    """The exit status a shell shows for this rank's end: its own, or 128 + the signal that killed it."""
    return failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode


def can_fork_ranks(args):
    """Whether each rank would be `python SCRIPT ...` with this very python, on a machine without a GPU."""
    if os.environ.get("MP_TORCHRUN_FORK", "1") == "0" or not hasattr(args, "run_path"):
        return False
    if args.run_path or args.no_python or args.module or os.environ.get("PYTHON_EXEC", sys.executable) != sys.executable:
        return False
    # device_count asks NVML, which leaves CUDA uninitialised here (a CUDA context does not survive a fork);
    # with a GPU the ranks stay new pythons: nccl in forked ranks has not been tried on this project's GPUs
    return os.path.isfile(args.training_script) and torch.cuda.device_count() == 0


def fork_ranks(args):
    """Run the ranks as forks of this process: torch._dynamo imported here once (each rank's first
    optimizer would import it), then torchrun's --run-path --start-method fork on forked_rank.py."""
    import torch._dynamo  # noqa: F401  (torch's Optimizer.add_param_group imports it on first use)
    args.training_script_args = [args.training_script] + args.training_script_args
    args.training_script = forked_rank.__file__
    args.run_path, args.start_method = True, "fork"


def start_ranks_with_sigint_blocked(args):
    """New-python ranks of this repository's programs start as the launchers start python (run_python,
    mp/tools/launch_checks.sh): with SIGINT blocked until the program's first lines have put its handler
    in place (mp/errors.py stop_on_interrupt). Each rank leads a session of its own, and the agent passes
    a Ctrl-C on to it as SIGINT: one that reached a rank still importing `site` would end in "Fatal
    Python error: init_import_site" and a traceback. A new process inherits the signal mask of the thread
    that started it, so the agent blocks SIGINT while it starts its ranks, and takes a Ctrl-C that came
    meanwhile once its ranks are in its hands (self._pcontext), to pass on to them."""
    ranks_are_python_script = not (args.run_path or args.no_python or args.module)
    if not ranks_are_python_script or os.path.dirname(os.path.abspath(args.training_script)) != REPOSITORY:
        return   # another script may never unblock SIGINT: torchrun's own start
    start_workers = LocalElasticAgent._start_workers

    def start_workers_with_sigint_blocked(agent, worker_group):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        try:
            return start_workers(agent, worker_group)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    LocalElasticAgent._start_workers = start_workers_with_sigint_blocked


def main(argv=None):
    quiet_torchrun()
    args = torchrun.parse_args(argv)
    program = args.training_script   # as torchrun names it in its report
    os.environ[LAUNCHER_PID] = str(os.getpid())   # each rank ends with this agent (mp.errors.end_with_launcher)
    if str(args.nproc_per_node).isdigit():
        note_shared_cores(int(args.nproc_per_node))
    if can_fork_ranks(args):
        fork_ranks(args)
    else:
        start_ranks_with_sigint_blocked(args)
    try:
        record(torchrun.run)(args)   # torchrun.main is this: parse_args, then run under @record
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode not in SAID_IT:
            how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
                   else f"exited with status {failure.exitcode}")
            print(f"error: rank {rank} (pid {failure.pid}) of {program} {how}", file=sys.stderr, flush=True)
        sys.exit(status_of(failure))
    except SignalException as e:   # Ctrl-C or a kill: torchrun stopped the ranks, each said its line
        sys.exit(128 + e.sigval)


if __name__ == "__main__":
    main()
