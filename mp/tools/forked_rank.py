"""One rank, forked from mp.tools.torchrun's agent instead of started as a new `python -u script.py`.

The agent has imported torch and torch._dynamo once; torchrun's own `--run-path --start-method fork`
forks it once per rank and runs this file there with the program and its arguments:

    agent (torchrun, imports done) --fork--> keeper (this file) --fork--> the program, as __main__

Why two processes a rank: torchrun counts a forked rank as finished only when its function returns,
and our programs end with os._exit (mp.dist.exit_now), which returns nothing: the agent would wait
for ever. So the program runs in a process of its own, and the keeper, the one torchrun watches,
waits for it and ends as it ended (returns on 0, else the same status or the same signal), passing
on every signal the agent sends (one it passed on to a program that then ended well ends it too: the
agent was stopping the rank, and would not take a return). The program's process is made to look like
a new interpreter's: default signal handlers, `python -u`'s unbuffered output, its own random state,
sys.argv and sys.path[0] as `python script.py` sets them, an uncaught exception printed with exit
status 1.
What cannot be made new: the string hash seed is the agent's, the same on every rank, so a set of
strings iterates in the same order on every rank here where new pythons' orders differ (code must not
order collectives that way; with a GPU the ranks are new pythons, and tests/test_real_torchrun.py runs
each program in new pythons too); and the modules the agent imported (torch, torch._dynamo, mp.errors,
this file) are not imported again.
"""
import ctypes
import faulthandler
import io
import os
import runpy
import signal
import sys
import traceback

from mp.errors import LAUNCHER_PID, end_with_launcher, say_when_interrupted

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)   # torchrun's agent sends these


def keep(script, args):
    """The keeper: start the program, pass signals on, and end as it ended."""
    end_with_launcher()   # killed, the agent would leave this keeper behind, and with it the program
    os.setsid()   # out of the terminal's reach, as torchrun's ranks are: a Ctrl-C reaches them through the agent only
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)   # held until the program's pid is known
    keeper = os.getpid()
    pid = os.fork()
    if pid == 0:
        run_program(script, args, keeper)
    passed_on = []

    def on_signal(signum, frame):
        passed_on.append(signum)
        pass_on(pid, signum)

    for sig in FORWARDED:
        signal.signal(sig, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    for sig in FORWARDED:   # the program is gone: a signal now ends the keeper, as it would have ended a finished
        signal.signal(sig, signal.SIG_DFL)   # rank (which torchrun's agent stops while it waits for the others)
    if status == 0 and passed_on:   # the agent's stop crossed the program's own end: a keeper that returned now
        os.kill(os.getpid(), passed_on[-1])   # would wait for the agent's word, and the agent 30 s for it to end
    if status == 0:
        return            # torchrun's agent takes a return as this rank's success
    sys.stdout.flush()
    if status < 0:        # killed by a signal: the same end, so the agent names the signal
        if -status != signal.SIGKILL:   # (whose handler cannot be set)
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status > 0 else 128 - status)


def pass_on(pid, signum):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def run_program(script, args, keeper):
    """The program's process: `python -u script args`, as far as the program can tell. Never returns."""
    for sig in FORWARDED:   # the agent's handlers raise its own exception: a new python has the defaults
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    die_with(keeper)
    os.environ[LAUNCHER_PID] = str(keeper)   # the program's own request (stop_on_interrupt) names its parent
    os.setsid()                     # torchrun's Popen(start_new_session=True): each rank leads a session of its own
    faulthandler.disable()          # torchrun's error handler turned it on in the agent
    say_when_interrupted(None)      # the agent's own Ctrl-C line ("no rank had started") is not the rank's
    if "numpy" in sys.modules:      # torch imported numpy in the agent: one global generator for all ranks
        sys.modules["numpy"].random.seed()   # (random reseeds itself after a fork; numpy does not)
    sys.stdin = open(0, closefd=False)      # multiprocessing gave the keeper /dev/null; python gives fd 0
    sys.stdout, sys.stderr = unbuffered(1, sys.stdout), unbuffered(2, sys.stderr)
    sys.argv = [script] + list(args)
    sys.path[0] = os.path.dirname(os.path.abspath(script))   # python script.py puts the script's folder first
    status = 1
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = exit_status(e)
    except KeyboardInterrupt:       # as python ends on one: the traceback, then killed by SIGINT
        traceback.print_exc()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 (as python prints an uncaught exception)
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)   # what a fork ends with: no interpreter shutdown (the agent's atexit work is not ours)


def exit_status(e):
    """What `python` exits with after SystemExit(e.code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def unbuffered(fd, like):
    """The stream `python -u` (torchrun's rank command) gives: every write goes straight to fd."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=like.encoding, errors=like.errors,
                            write_through=True)


def die_with(keeper):
    """If the keeper is killed (torchrun's agent ends with SIGKILL a rank that ignored SIGTERM for 30 s),
    the program goes with it, as the rank itself would have: Linux's PR_SET_PDEATHSIG."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1: PR_SET_PDEATHSIG
    if os.getppid() != keeper:    # the keeper was gone before the request took effect
        os._exit(128 + signal.SIGKILL)


if __name__ == "__main__":
    keep(sys.argv[1], sys.argv[2:])
