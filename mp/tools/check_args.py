"""Check the arguments of every run a launcher will start, in one process, before anything trains:

    python -m mp.tools.check_args [--launcher run_pipeline.sh] NPROC PROGRAM ARGS... [:: NPROC PROGRAM ARGS...]

Each run is checked as its ranks will check it: the program's own parser and checks (mp/cli.py)
under WORLD_SIZE=NPROC, so the world-size arithmetic (stages, replicas, tp degree) is the one
torchrun's ranks will see. The first refused run prints the program's one `error:` line and exit
status 2. No torch is imported, so this answers in a fraction of a second (importing torch takes
2-3 s, and each launcher used to import it once per run it checked). What only torch can read (a
checkpoint's files, --balance auto's counted flops) each program checks when it starts, before any
collective.

A run with --backend nccl needs a GPU a rank: the GPUs this machine shows are counted without torch
(the NVIDIA driver's /proc and /dev entries, CUDA_VISIBLE_DEVICES), so that a machine without one is
refused here, in a fraction of a second, not after the baseline has trained. Where there are GPUs
but fewer than ranks, whether ranks may share one depends on the NCCL library torch loads: that one
case is checked with torch, in a python of its own (mp.dist.torchrun_env, as each rank will).

--launcher names the launcher for single_baseline.py's refusals and for a flag the parallel program
does not take: the launcher passes its extra flags to both programs, and the line says so; --knobs
"flag:KNOB:kind ..." (the launcher's KNOBS) lets that line name the knob a mistyped flag resembles."""
from mp.errors import say_when_interrupted, stop_on_interrupt
if __name__ == "__main__":
    say_when_interrupted(lambda: "interrupted while checking the arguments; nothing has run")
    stop_on_interrupt()      # Ctrl-C: one line and exit 130, not a traceback (the launcher then leaves quietly)

import contextlib
import difflib
import glob
import io
import os
import subprocess
import sys

from mp.cli import PARSERS
from mp.errors import fail, note_shared_cores

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


def check(world, program, args, launcher=None, knobs=()):
    """One run's flags, as its ranks will parse them; exits 2 with the error line if refused. Under a
    launcher, a flag no program takes is said in its terms: the extra flags reach both programs, and a
    flag that looks like one a knob sets names the knob (--num-experts 8: EXPERTS=8)."""
    os.environ["WORLD_SIZE"] = str(world)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = PARSERS[program](args, None)
    except SystemExit:
        reason = err.getvalue().strip().removeprefix("error: ")
        if launcher is None or (program != "single_baseline" and not reason.startswith(UNKNOWN)):
            sys.stderr.write(err.getvalue())
            raise
        if program == "single_baseline":
            fail(f"{launcher} passes its extra flags to single_baseline.py too, which refused them: {reason}")
        fail(unknown_flags(launcher, program, reason, knobs))
    sys.stderr.write(err.getvalue())   # a note, if the program printed one
    if getattr(parsed, "backend", None) == "nccl":
        check_gpus(world)


UNKNOWN = "unrecognized arguments: "


def unknown_flags(launcher, program, reason, knobs):
    """The launcher's line for extra flags that the parallel program does not take: which program
    refused them, and the knob that a flag looks like, with the value the user gave it."""
    typed, _, near = reason.removeprefix(UNKNOWN).removesuffix(" (see --help)").partition(": did you mean ")
    words = typed.split()
    line = (f"{launcher} passes its extra flags to {program}.py and single_baseline.py, and {program}.py does "
            f"not take {typed} (python {program}.py --help lists its flags)")
    flag = words[0].split("=")[0] if words and words[0].startswith("--") else None
    value = words[0].partition("=")[2] or (words[1] if len(words) > 1 and not words[1].startswith("--") else "")
    knob = flag and like_a_knob(flag, knobs)
    if knob:
        setting = f"{knob}={value}" if value else knob
        line += f"; to set {knob.lower().replace('_', ' ')}, use the knob: {setting} bash {launcher}"
    elif near:   # a flag of the program's, mistyped (mp.flags.OneLineParser.did_you_mean)
        line += f"; did you mean {near}"
    return line


def like_a_knob(flag, knobs):
    """The knob whose flag the typed one resembles (--num-experts, --expert: --experts's EXPERTS), or None."""
    name = flag.lstrip("-")
    pairs = [pair.split(":") for pair in knobs]
    for knob_flag, knob, _ in pairs:
        bare = knob_flag.lstrip("-")
        if bare in name or name in bare:
            return knob
    close = difflib.get_close_matches(name, [knob_flag.lstrip("-") for knob_flag, _, _ in pairs], n=1, cutoff=0.7)
    return next((knob for knob_flag, knob, _ in pairs if close and knob_flag.lstrip("-") == close[0]), None)


def visible_gpus():
    """How many GPUs a process here would see, read without torch: the NVIDIA driver's entries
    (/proc/driver/nvidia/gpus, else /dev/nvidiaN), narrowed by CUDA_VISIBLE_DEVICES as CUDA reads it
    (up to the first entry that is not a device: "" or "-1" hides them all)."""
    found = len(glob.glob("/proc/driver/nvidia/gpus/*")) or len(glob.glob("/dev/nvidia[0-9]*"))
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return found
    count = 0
    for entry in chosen.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        count += 1
    return min(count, found)


def check_gpus(world):
    """--backend nccl: a GPU for each local rank (a launcher's ranks are all local), or GPUs that
    ranks may share (NCCL 2.30+ with its switch: only torch can tell, so that case asks it)."""
    gpus = visible_gpus()
    if gpus == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU" if hidden is not None and glob.glob("/dev/nvidia[0-9]*")
               else "no NVIDIA GPU or driver found")
        fail(f"--backend nccl runs on GPUs, one a rank at world size {world}, and this machine shows none ({why}); "
             f"use --backend gloo (the CPU), or --backend auto, which takes gloo where there is no GPU")
    if gpus < world:   # may the ranks share? the loaded NCCL decides: ask torch, as each rank will
        env = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), LOCAL_RANK="0", RANK="0")
        status = subprocess.run([sys.executable, "-c", "from mp.dist import torchrun_env; torchrun_env('nccl')"],
                                env=env, stdout=subprocess.DEVNULL).returncode
        if status:
            sys.exit(status)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    launcher, knobs = None, ()
    if argv[:1] == ["--launcher"]:
        launcher, argv = argv[1], argv[2:]
    if argv[:1] == ["--knobs"]:       # the launcher's flags that have a knob, flag:KNOB:kind (launch_checks.sh)
        knobs, argv = argv[1].split(), argv[2:]
    planned = runs(argv)
    for world, program, args in planned:
        check(world, program, args, launcher, knobs)
    note_shared_cores(max(world for world, _, _ in planned))   # the launcher's one word on it (MP_CORES_NOTED)


if __name__ == "__main__":
    main()
