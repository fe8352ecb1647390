"""The benchmarks' own flags: a mistake is one `error:` line that says the fix, and exit status 2
(mp.flags.OneLineParser, or Parser where a benchmark takes the programs' flags), never argparse's
usage block or a traceback. In-process and fast: each script's entry point runs under a patched
sys.argv and stops at its parser, before anything is measured."""
import argparse
import importlib
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# script: (entry point, its flags: one bad value, the rest what it requires)
BAD_VALUE = {
    "bench_3d": ("main", ["--steps", "x"]),
    "block_costs": ("main", ["--repeat", "x"]),
    "dropout_cost": ("main", ["--rounds", "x"]),
    "hot_path": ("main", ["--before", "/nowhere", "--rounds", "x"]),
    "memory_per_rank": ("main", ["--hidden", "x"]),
    "report": ("main", ["--repeat", "x"]),
    "tp_ladder": ("main", ["--steps", "x"]),
    "zb_joint": ("main", ["--rounds", "x"]),
    "zero_bubble": ("main", ["--rounds", "x"]),
    "zero_memory": ("main", ["--rounds", "x"]),
    "tp_hybrid": ("main", ["--out", "x.json", "--repeat", "x"]),                  # mp.flags.base_parser
    "sequence_parallel": ("worker", ["--out", "x.json", "--repeat", "x"]),       # its --worker's parser
}


class Accepted(Exception):
    """The flags parsed: the test stops here rather than run the benchmark."""


@pytest.fixture
def stop_after_parsing(monkeypatch):
    """argparse's parse_args raises Accepted where it would return, so flags let through fail the test
    at once instead of starting a benchmark (Parser's own checks come after it: none are tested here)."""
    real = argparse.ArgumentParser.parse_args

    def parse_or_stop(self, args=None, namespace=None):
        raise Accepted(real(self, args, namespace))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_or_stop)


def one_error_line(script, entry, argv, monkeypatch, capsys):
    """The script's entry point run on argv must exit 2 with one `error:` line on stderr and nothing
    else; that line, without its newline."""
    monkeypatch.delenv("RANK", raising=False)                      # fail() prints on rank 0
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    main = getattr(importlib.import_module(script), entry)
    with pytest.raises(SystemExit) as exit_:
        main(argv) if entry == "worker" else main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, (exit_.value.code, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "usage:" not in err, err
    return err.rstrip("\n")


@pytest.mark.parametrize("script", BAD_VALUE)
def test_a_bad_flag_value_is_one_error_line(script, stop_after_parsing, monkeypatch, capsys):
    entry, argv = BAD_VALUE[script]
    assert one_error_line(script, entry, argv, monkeypatch, capsys) == \
        f"error: argument {argv[-2]}: invalid int value: 'x' (see --help)"


def test_an_abbreviated_flag_is_refused(stop_after_parsing, monkeypatch, capsys):
    """No abbreviations, as in the programs: --round is not taken for --rounds."""
    assert one_error_line("zero_bubble", "main", ["--round", "1"], monkeypatch, capsys) == \
        "error: unrecognized arguments: --round 1: did you mean --rounds? (see --help)"


# zero_bubble.py's checks after parsing: flags, what the line says first, the fix it must name
ZERO_BUBBLE_CHECKS = [
    (["--paired", "-1"], "--paired -1:", "give the rounds to run, 1 or more"),
    (["--paired-stages", "3"], "--paired-stages 3 goes with", "add one of them, or drop --paired-stages"),
    (["--even-split"], "--even-split goes with", "add one of them (not --paired), or drop --even-split"),
    (["--paired-zbv", "1", "--paired-stages", "1"], "--paired-stages 1:", "give 2 or more"),
    (["--paired", "1", "--paired-stages", "3"], "--paired-stages 3:", "drop --paired-stages there"),
]


@pytest.mark.parametrize("argv, said, fix", ZERO_BUBBLE_CHECKS, ids=[" ".join(c[0]) for c in ZERO_BUBBLE_CHECKS])
def test_zero_bubbles_own_checks_say_the_fix(argv, said, fix, monkeypatch, capsys):
    """zero_bubble.py's checks after parsing (p.error) come out in the same one line, with the fix."""
    zero_bubble = importlib.import_module("zero_bubble")
    for name in ("run_paired", "measure", "pieces"):      # flags the checks let through fail here
        monkeypatch.setattr(zero_bubble, name, lambda *a, **k: pytest.fail(f"{argv} passed the checks"))
    err = one_error_line("zero_bubble", "main", argv, monkeypatch, capsys)
    assert err.startswith(f"error: {said}") and fix in err and err.endswith(" (see --help)"), err


def test_sequence_parallels_driver_refuses_a_mistyped_flag(monkeypatch, capsys):
    """Its driver read --out and --cuts out of sys.argv by hand: --cut was ignored and the whole
    benchmark ran (and so did --help)."""
    sequence_parallel = importlib.import_module("sequence_parallel")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        sequence_parallel.parse_driver(["--cut"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == "error: unrecognized arguments: --cut: did you mean --cuts? (see --help)\n", err
    assert sequence_parallel.parse_driver(["--cuts", "--out", "x.json"]).cuts
