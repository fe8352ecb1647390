"""torchrun reads the options after the script name too, and takes any that abbreviate one of its
own flags (`--log` for `--log-dir`, ...). Every flag of every program must reach the program."""
import importlib
import io
import os
import subprocess
from contextlib import redirect_stderr

import pytest
from torch.distributed.run import get_args_parser

from mp import flags as mp_flags
from helpers import PYTHON, ROOT

PROGRAMS = ["single_baseline", "pipeline_microbatch", "pipeline_dp_joint", "tensor_parallel", "parallel_3d",
            "parallel_5d", "context_parallel", "expert_parallel"]


class Captured(Exception):
    pass


def program_parser(name, monkeypatch):
    """The program's own parser, caught as its parse_args() is about to run."""
    def capture(self, *args, **kwargs):
        raise Captured(self)
    monkeypatch.setattr(mp_flags.Parser, "parse_args", capture)
    with pytest.raises(Captured) as caught:
        importlib.import_module(name).parse_args([])
    return caught.value.args[0]


@pytest.mark.parametrize("program", PROGRAMS)
def test_no_flag_is_taken_by_torchrun(program, monkeypatch):
    flags = [s for a in program_parser(program, monkeypatch)._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"]
    assert "--log-file" in flags and "--data" in flags        # the parser was really found
    taken = []
    for flag in flags:
        argv = ["--standalone", "--nproc-per-node", "2", f"{program}.py", flag, "1"]
        try:
            with redirect_stderr(io.StringIO()):
                parsed = get_args_parser().parse_args(argv)
        except SystemExit:
            taken.append(flag)
            continue
        if parsed.training_script_args != [flag, "1"]:
            taken.append(flag)
    assert not taken, f"torchrun's parser takes these flags of {program}: {taken}"


def test_the_old_log_flag_would_have_been_taken():
    """The check above can fail: `--log` is what torchrun took before the rename."""
    with pytest.raises(SystemExit), redirect_stderr(io.StringIO()):
        get_args_parser().parse_args(["--standalone", "x.py", "--log", "a.jsonl"])


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_at_world_size_1_shows_every_default(program, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    run = subprocess.run([PYTHON, os.path.join(ROOT, f"{program}.py"), "--help"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())              # help wraps lines anywhere
    missing = [a.option_strings[0] for a in program_parser(program, monkeypatch)._actions
               if a.option_strings and a.default is not None and a.default is not False and a.default != "==SUPPRESS=="
               and f"(default: {a.default}" not in text]
    assert not missing, f"{program} --help shows no default for {missing}"
    if program == "pipeline_dp_joint":               # its own defaults, different from the pipeline's
        assert "--batch-size 72 (not 64)" in text and "(default: 72)" in text and "(default: 3)" in text
