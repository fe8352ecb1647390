"""Test-only: hold one python at a named moment of its start-up until its signal has reached it, so
that a Ctrl-C lands at that moment on a quiet machine and on a busy one alike (no wall-clock delay
decides where it lands). tests/test_user_files.py puts this folder on PYTHONPATH and sets

    MOMENTS=DIR         the folder the test and the held process share
    MOMENT=WHO@WHERE    WHO: what python runs, a script's name or the module after -m
                        (single_baseline.py, mp.tools.torchrun): the first python that runs it is
                        held; every other python runs on untouched
                        WHERE: site     now: python imports this file from `site`, inside
                                        init_import_site, before any line of the program runs
                               MODULE   when the program first imports MODULE (torch, matplotlib),
                                        after its own first lines

At the moment the held process creates DIR/reached (exclusively: one process only) and waits, for at
most 60 s, until the signal has reached it: the test sends it once it sees DIR/reached, to the whole
session or, for torchrun's ranks, through the agent, which passes a Ctrl-C on later. Whatever the
signal does on arrival is what it would do to an unheld python there: a KeyboardInterrupt raised while
this file is imported is fatal to python's start-up, as it is when a Ctrl-C lands in site's own
imports; a handler of the program's ends the process; a blocked SIGINT stays pending (the wait ends)."""
import os
import signal
import sys
import time

_MOMENT = os.environ.get("MOMENT", "")
_DIR = os.environ.get("MOMENTS", "")


def _hold():
    try:
        os.close(os.open(os.path.join(_DIR, "reached"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:   # another process was held already
        return
    deadline = time.monotonic() + 60
    while signal.SIGINT not in signal.sigpending() and time.monotonic() < deadline:
        time.sleep(0.002)


def _program(argv):
    """The script's name, or the module after -m, in python's command line."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, "")
        if not arg.startswith("-"):
            return os.path.basename(arg)
    return ""


class _HoldAtImport:
    """A meta-path finder that finds nothing: it only holds the process when MODULE is first asked for."""

    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            sys.meta_path.remove(self)
            _hold()
        return None


if _DIR and "@" in _MOMENT:
    _who, _where = _MOMENT.split("@", 1)
    if _program(sys.orig_argv) == _who:
        if _where == "site":
            _hold()
        else:
            sys.meta_path.insert(0, _HoldAtImport(_where))
