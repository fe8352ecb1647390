"""The launchers' knobs, checked in the environment before a launcher does anything:

    python -m mp.tools.knobs run_tp.sh             (what each run_*.sh runs first)

A knob is read from the environment, so a mistyped one is not an error by itself: `SCHEDUEL=zb bash
run_pipeline.sh` would run the default schedules in silence, and `SCHEDULE=zb bash run_tp.sh` would
train something else than the user meant. Refused here, with one `error:` line and exit status 2:
a set variable that is a knob of another launcher only, and one a typo away from one of this
launcher's knobs (a letter wrong, missing, extra or swapped, or the wrong case). Each launcher's
knobs are read from its file (`knob NAME default`, or `NAME=${NAME:-default}`). Only the standard
library and mp.errors: it runs before torch is imported."""
from mp.errors import say_when_interrupted, stop_on_interrupt
if __name__ == "__main__":   # Ctrl-C now: one line and exit 130 (the launcher then leaves quietly)
    say_when_interrupted(lambda: "interrupted while checking the knobs; nothing has run")
    stop_on_interrupt()

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECLARED = re.compile(r"^(?:\s*knob ([A-Z][A-Z0-9_]*) |([A-Z][A-Z0-9_]*)=\$\{\2:-)", re.M)
SHARED = os.path.join(ROOT, "mp", "tools", "launch_checks.sh")   # shared_knobs: the knobs every launcher has
MIN_TYPO_LENGTH = 4    # TP, DP: too short to tell a typo from another program's variable (TZ, DISPLAY...)


def knobs_of(launcher):
    with open(launcher) as f:
        text = f.read()
    if re.search(r"^shared_knobs\b", text, re.M):
        with open(SHARED) as f:
            text += f.read()
    return {a or b for a, b in DECLARED.findall(text)}


def one_edit_apart(a, b):
    """Equal but for one letter changed, added, dropped, or two neighbours swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def problem(name, mine, others, launcher):
    """What is wrong with the environment variable `name` for this launcher, or None."""
    if name in mine:
        return None
    if name in others:
        where = ", ".join(sorted(others[name]))
        return (f"{name} is a knob of {where}, not of {launcher}, which would ignore it: unset it "
                f"(env -u {name} bash {launcher}), or run a launcher that reads it")
    near = [k for k in sorted(mine) if len(k) >= MIN_TYPO_LENGTH and
            (name.upper() == k or (name.isupper() and one_edit_apart(name, k)))]
    if near:
        return (f"{name} is set, and {launcher} has no such knob: did you mean {near[0]}? "
                f"(unset {name}; {launcher} would ignore it)")
    return None


def main(argv=None):
    launcher, = sys.argv[1:] if argv is None else argv
    mine, others = knobs_of(os.path.join(ROOT, launcher)), {}
    for path in sorted(glob.glob(os.path.join(ROOT, "run_*.sh"))):
        if os.path.basename(path) != launcher:
            for knob in knobs_of(path):
                others.setdefault(knob, set()).add(os.path.basename(path))
    for name in sorted(os.environ):
        message = problem(name, mine, others, launcher)
        if message:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    main()
