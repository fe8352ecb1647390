"""What every part of the package may need and none may import in a circle: the one `error:` line
for bad input (fail), the one line of a Ctrl-C, the note for a one-rank launch, and the error a
communication failure raises. A leaf: it imports nothing of the project."""
import json
import os
import signal
import sys
import time


def print_error(message):
    """One `error:` line in a single write, so the lines of ranks sharing a stderr pipe never interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    tell_torchrun(message)


def tell_torchrun(message):
    """Under plain torchrun, leave the `error:` line where its report of a failed rank looks: the file it
    names in TORCHELASTIC_ERROR_FILE (what torch's @record writes for an exception). Its report, which
    ends the output, then shows the line as the rank's "traceback" under Root Cause instead of a link
    to torch's docs, so the line is among the last a user sees. A plain string message: no traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # whole or not at all: written beside it, then renamed over it. Opened in place, the file was empty for a
    # moment, and torchrun's agent, reading it then (another rank had failed: it stops this one), died on
    # the empty JSON with a traceback of its own (tests/test_robustness.py's hung joint run, once in CI)
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "w") as f:
            json.dump({"message": f"error: {message}", "timestamp": int(time.time())}, f)
        os.replace(part, path)
    except OSError:
        pass   # the console line is already out; torchrun then shows its own text


def fail(message, seen_by="every rank"):
    """Bad input: one `error:` line and exit status 2 on every rank, printed once where it is seen.
    seen_by "every rank": what every rank checks alike (the flags, WORLD_SIZE), printed by rank 0;
    "every node": what each machine checks for itself (its --data-dir), printed by each node's local
    rank 0, so a node whose files are damaged says so even when rank 0's are fine; "this rank": what
    only this rank detects (a NaN loss on the loss owner), printed here."""
    printer = {"every rank": "RANK", "every node": "LOCAL_RANK", "this rank": None}[seen_by]
    if printer is None or int(os.environ.get(printer, 0)) == 0:
        print_error(message)
    else:
        tell_torchrun(message)   # said once on the console; every rank's report says it
        outlast_the_printer()
    sys.exit(2)


PRINTER_WAIT_S = 30


def outlast_the_printer():
    """A rank that leaves the error line to another must not leave first: torchrun stops the other
    ranks (SIGTERM) as soon as one exits, and on a loaded machine the rank that prints may not have
    printed yet, so the user would get torchrun's report with no `error:` line. Under torchrun this
    rank waits; the printing rank's exit makes torchrun end the wait. Bounded, so it never hangs."""
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        time.sleep(PRINTER_WAIT_S)


def note_one_rank(what):
    """A parallel program started as one process (python prog.py, or torchrun with one rank) runs, as
    the contract allows, but splits nothing: say so once, with what to launch instead."""
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        print(f"note: one rank (WORLD_SIZE 1): {what}; launch it with torchrun --nproc-per-node N to split "
              f"the work over N ranks", flush=True)


_interrupted_line = None   # () -> what this rank says when interrupted (None: nothing); set by the loop


def say_when_interrupted(line):
    global _interrupted_line
    _interrupted_line = line


def stop_on_interrupt():
    """Ctrl-C sends SIGINT to every process of the terminal's job: the launcher, torchrun and each
    rank (torchrun passes it on too). Each rank leaves at once with exit status 130; raising
    KeyboardInterrupt instead would unwind through a collective that a peer has already left and print
    a traceback or a false "waited ..." error on every rank. The log was flushed line by line, so its
    partial file stays valid; one rank says where it is (say_when_interrupted). The launchers start
    python with SIGINT blocked, so that a Ctrl-C during the interpreter's own start-up waits for this
    handler (mp/tools/launch_checks.sh, run_python): unblocked here, after the handler is in place, so
    a program sets its line (say_when_interrupted) before it calls this."""
    signal.signal(signal.SIGINT, _leave_interrupted)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _leave_interrupted(signum, frame):
    if _interrupted_line is not None:
        line = _interrupted_line()
    else:   # not training yet: rank 0 speaks for all
        line = "interrupted during set-up, before the first step" if int(os.environ.get("RANK", 0)) == 0 else None
    try:
        sys.stdout.flush()    # the progress lines so far (a print this handler interrupted may refuse)
    except RuntimeError:
        pass
    if line:
        os.write(2, (line + "\n").encode())
    os._exit(130)


class CommError(RuntimeError):
    """A message or collective that gave up (timeout, or a peer that died): the job cannot go on."""
