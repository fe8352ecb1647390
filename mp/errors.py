"""What every part of the package may need and none may import in a circle: the one `error:` line
for bad input (fail), the note for a one-rank launch, and the error a communication failure raises.
A leaf: it imports nothing of the project."""
import os
import sys


def print_error(message):
    """One `error:` line in a single write, so the lines of ranks sharing a stderr pipe never interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def fail(message, seen_by="every rank"):
    """Bad input: one `error:` line and exit status 2 on every rank, printed once where it is seen.
    seen_by "every rank": what every rank checks alike (the flags, WORLD_SIZE), printed by rank 0;
    "every node": what each machine checks for itself (its --data-dir), printed by each node's local
    rank 0, so a node whose files are damaged says so even when rank 0's are fine; "this rank": what
    only this rank detects (a NaN loss on the loss owner), printed here."""
    printer = {"every rank": "RANK", "every node": "LOCAL_RANK", "this rank": None}[seen_by]
    if printer is None or int(os.environ.get(printer, 0)) == 0:
        print_error(message)
    sys.exit(2)


def note_one_rank(what):
    """A parallel program started as one process (python prog.py, or torchrun with one rank) runs, as
    the contract allows, but splits nothing: say so once, with what to launch instead."""
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        print(f"note: one rank (WORLD_SIZE 1): {what}; launch it with torchrun --nproc-per-node N to split "
              f"the work over N ranks", flush=True)


class CommError(RuntimeError):
    """A message or collective that gave up (timeout, or a peer that died): the job cannot go on."""
