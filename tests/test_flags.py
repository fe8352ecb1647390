"""torchrun reads the options after the script name too, and takes any that abbreviate one of its
own flags (`--log` for `--log-dir`, ...). Every flag of every program must reach the program."""
import importlib
import io
from contextlib import redirect_stderr

import pytest
from torch.distributed.run import get_args_parser

import common

PROGRAMS = ["single_baseline", "pipeline_microbatch", "pipeline_dp_joint", "tensor_parallel"]


class Captured(Exception):
    pass


def program_parser(name, monkeypatch):
    """The program's own parser, caught as its parse_args() is about to run."""
    def capture(self, *args, **kwargs):
        raise Captured(self)
    monkeypatch.setattr(common.Parser, "parse_args", capture)
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
