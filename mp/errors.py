"""What every part of the package may need and none may import in a circle: the one `error:` line
for bad input (fail), the one line of a Ctrl-C, the note for a one-rank launch, and the error a
communication failure raises. A leaf: it imports nothing of the project."""
import ctypes
import json
import os
import signal
import sys
import threading
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


def cores():
    """The cores this process may run on (a container's or taskset's limit, where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shared_cores(ranks):
    """Why ranks that outnumber the cores time slower: "" when each rank has a core."""
    if ranks <= cores():
        return ""
    n = cores()
    return f"{ranks} ranks share this machine's {n} core{'s' if n > 1 else ''}, at most {n} computing at once"


def note_shared_cores(ranks):
    """Once, where ranks are started: more ranks than cores (the results stay exact; the times do not)."""
    why = shared_cores(ranks)
    if why and not os.environ.get("MP_CORES_NOTED"):
        print(f"note: {why}: step times are longer than with a core a rank, and a pipeline's measured bubble "
              f"counts a rank's wait for a core as idle time (the losses are the same)", flush=True)
        os.environ["MP_CORES_NOTED"] = "1"   # said: the ranks started from here, and later launches, stay quiet


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
    end_with_launcher()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _leave_from_any_wait()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _leave_from_any_wait():
    """Python runs a handler in the main thread between two bytecodes, so a rank in a C++ wait (the
    connect to torchrun's store, init_process_group waiting for a peer, a collective) would take a Ctrl-C
    only when the wait ends: torchrun's agent kills it 30 s later instead (measured: a Ctrl-C 31 s long,
    over the test's limit under load). Python's own C-level handler also writes the signal's number to a
    wakeup fd; this thread reads it and leaves at once, wherever the main thread waits."""
    read, write = os.pipe()
    os.set_blocking(write, False)   # the C handler must never block
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def listen():
        while True:
            if signal.SIGINT in os.read(read, 64) and signal.getsignal(signal.SIGINT) is _leave_interrupted:
                _leave_interrupted(signal.SIGINT, None)
    threading.Thread(target=listen, name="leave_on_ctrl_c", daemon=True).start()


_leaving = threading.Lock()   # the handler and the thread above may both run: one line, one exit


def _leave_interrupted(signum, frame):
    if not _leaving.acquire(blocking=False):
        return   # the other is leaving (a second Ctrl-C in the handler returns here too, never blocks)
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


LAUNCHER_PID = "MP_LAUNCHER_PID"   # who started this process and must not leave it behind (its pid)


def end_with_launcher():
    """No rank outlives its launcher. A rank whose torchrun agent was killed (SIGKILL, a crash) would
    otherwise run on: in init_process_group's connect to the agent's store, a C++ wait that a Ctrl-C
    cannot interrupt (python runs its handler only when the wait returns), for --timeout-s (3 minutes).
    Linux ends this process with SIGTERM when its parent ends (prctl PR_SET_PDEATHSIG); elsewhere a
    thread watches the parent. Only a launched process: a torchrun rank, or one whose launcher named
    itself in MP_LAUNCHER_PID (mp.tools.torchrun for its ranks, the run_*.sh launchers for their
    pythons); `python prog.py` or `nohup ...` typed by hand may outlive its shell, as any program."""
    launcher = int(os.environ.pop(LAUNCHER_PID, 0) or 0)   # popped: this process's own children have another parent
    if not launcher and "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if not _die_with_parent(signal.SIGTERM):
        _watch_parent(os.getppid())
    # the launcher may have ended before the request took effect (this process was then handed to a reaper);
    # not knowable under plain torchrun, whose agent may be pid 1 itself (a container's first process)
    if launcher and os.getppid() != launcher and not _alive(launcher):
        os.kill(os.getpid(), signal.SIGTERM)


def _die_with_parent(sig):
    """Linux's PR_SET_PDEATHSIG (1): sig when the thread that started this process ends. False elsewhere."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, sig) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent):
    """Without prctl (macOS): a thread that ends this process once its parent has changed (it ended)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, name="end_with_launcher", daemon=True).start()


def _alive(pid):
    """Whether pid runs (a zombie, ended but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class CommError(RuntimeError):
    """A message or collective that gave up (timeout, or a peer that died): the job cannot go on."""
