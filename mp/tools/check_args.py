"""Check the arguments of every run a launcher will start, in one process, before anything trains:

    python -m mp.tools.check_args [--launcher run_pipeline.sh] NPROC PROGRAM ARGS... [:: NPROC PROGRAM ARGS...]

Each run is checked as its ranks will check it: the program's own parser and checks (mp/cli.py)
under WORLD_SIZE=NPROC, so the world-size arithmetic (stages, replicas, tp degree) is the one
torchrun's ranks will see. The first refused run prints the program's one `error:` line and exit
status 2. No torch is imported, so this answers in a fraction of a second (importing torch takes
2-3 s, and each launcher used to import it once per run it checked). What only torch can read (a
checkpoint's files, --balance auto's counted flops) each program checks when it starts, before any
collective.

--launcher names the launcher for single_baseline.py's refusals: the launcher passes its extra
flags to the baseline too, and the line says so."""
from mp.errors import say_when_interrupted, stop_on_interrupt
if __name__ == "__main__":
    say_when_interrupted(lambda: "interrupted while checking the arguments; nothing has run")
    stop_on_interrupt()      # Ctrl-C: one line and exit 130, not a traceback (the launcher then leaves quietly)

import contextlib
import io
import os
import sys

from mp.cli import PARSERS
from mp.errors import fail

SEPARATOR = "::"


def runs(argv):
    """[(world size, program, its arguments)] from NPROC PROGRAM ARGS... [:: NPROC PROGRAM ARGS...]."""
    out, run = [], []
    for arg in argv + [SEPARATOR]:
        if arg != SEPARATOR:
            run.append(arg)
            continue
        if len(run) < 2 or not run[0].isdigit() or run[1] not in PARSERS:
            fail(f"mp.tools.check_args: expected NPROC PROGRAM ARGS..., got {' '.join(run) or 'nothing'} "
                 f"(PROGRAM one of {', '.join(PARSERS)})")
        out.append((int(run[0]), run[1], run[2:]))
        run = []
    return out


def check(world, program, args, launcher=None):
    """One run's flags, as its ranks will parse them; exits 2 with the error line if refused."""
    os.environ["WORLD_SIZE"] = str(world)
    if program != "single_baseline" or launcher is None:
        PARSERS[program](args, None)
        return
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            PARSERS[program](args, None)
    except SystemExit:
        reason = err.getvalue().strip().removeprefix("error: ")
        fail(f"{launcher} passes its extra flags to single_baseline.py too, which refused them: {reason}")
    sys.stderr.write(err.getvalue())   # a note, if the baseline printed one


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    launcher = None
    if argv[:1] == ["--launcher"]:
        launcher, argv = argv[1], argv[2:]
    for world, program, args in runs(argv):
        check(world, program, args, launcher)


if __name__ == "__main__":
    main()
