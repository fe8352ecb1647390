"""The error lines docs/robustness.md shows are what the programs print for the commands shown
beside them (argument checks only: nothing trains)."""
import os
import re
import shlex
import subprocess

import pytest

from helpers import PYTHON, ROOT


def examples():
    text = open(os.path.join(ROOT, "docs", "robustness.md")).read()
    pairs = re.findall(r"^\$ (.+)\n(error: .+)$", text, re.M)
    assert len(pairs) >= 6, pairs
    return [(cmd.split("#")[0].strip(), line) for cmd, line in pairs if "..." not in line]


@pytest.mark.parametrize("command,line", examples())
def test_each_example_prints_its_error_line(command, line):
    words = shlex.split(command)
    world = 1
    if words[:3] == ["python", "-m", "mp.tools.torchrun"]:
        words = words[2:]                                  # the repo's torchrun, as the docs launch it
    if words[0] in ("torchrun", "mp.tools.torchrun"):
        world = int(words[words.index("--nproc-per-node") + 1])
        words = words[words.index("--") + 1:]
    else:
        words = words[1:]                                  # python
    program, args = words[0][:-len(".py")], words[1:]
    env = dict(os.environ, WORLD_SIZE=str(world))
    if world == 1:
        env.pop("WORLD_SIZE")
    run = subprocess.run([PYTHON, "-c", f"import sys, {program} as p; p.parse_args(sys.argv[1:])", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.splitlines() == [line], run.stderr
