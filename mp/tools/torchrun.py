"""torchrun as the launchers run it: `python -m mp.tools.torchrun ARGS` is `torchrun ARGS`, the same
agent, options and ranks, with torchrun's own output cut to what the user needs.

When a rank fails, torchrun prints its log lines and a report of 40-55 lines (its own traceback, then
a table naming the rank and exit code) after the one line in which our program already said what
went wrong (`error: ...`, exit status 2) or that it was interrupted (Ctrl-C, exit status 130). Here
torchrun's logging is silenced and its final exception is caught: a rank that said something leaves
it as the last word, a rank that died without a word (killed by a signal) gets one `error:` line
naming it, and the exit status is the failed rank's own (2, 130, ...), not torchrun's 1.

    python -m mp.tools.torchrun --standalone --nproc-per-node 4 -- pipeline_microbatch.py --steps 10
"""
from mp.errors import say_when_interrupted, stop_on_interrupt
if __name__ == "__main__":   # Ctrl-C while torch is imported (seconds): one line, exit 130; no rank has started
    stop_on_interrupt()      # (torchrun's agent puts its own handler in place when it starts the ranks)
    say_when_interrupted(lambda: "interrupted while torchrun started: no rank had started")

import logging
import sys

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

SAID_IT = (1, 2, 130)   # our programs' exit statuses, each after its own line (1: a communication failure)


def quiet_torchrun():
    """torchrun's agent logs through one logger per module, each with its own level."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def status_of(failure):
    """The exit status a shell shows for this rank's end: its own, or 128 + the signal that killed it."""
    return failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode


def main(argv=None):
    quiet_torchrun()
    try:
        torchrun.main(argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode not in SAID_IT:
            how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
                   else f"exited with status {failure.exitcode}")
            print(f"error: rank {rank} (pid {failure.pid}) of {e.name} {how}", file=sys.stderr, flush=True)
        sys.exit(status_of(failure))
    except SignalException as e:   # Ctrl-C or a kill: torchrun stopped the ranks, each said its line
        sys.exit(128 + e.sigval)


if __name__ == "__main__":
    main()
