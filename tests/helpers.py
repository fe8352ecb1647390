"""Launch a program as a user would (python, or torchrun for several ranks) and read its log; or run
a test's function on several spawned gloo ranks."""
import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--data", "synthetic", "--eval-every", "0", "--threads", "1"]  # what most tests add


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    records: list

    def losses(self):
        return [r["loss"] for r in self.records if r["event"] == "train"]

    def events(self, name):
        return [r for r in self.records if r["event"] == name]


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch(program, args, tmp_path, nproc=1, timeout=240, log_name=None):
    """Run `program` (a file in the repository root) with `args`; nproc > 1 goes through
    `torchrun --standalone`. The log goes to tmp_path; returns a Run with its records."""
    log = os.path.join(str(tmp_path), log_name or f"{os.path.splitext(program)[0]}-{nproc}.jsonl")
    script = os.path.join(ROOT, program)
    if nproc == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "--", script]  # "--": torchrun 2.13 would take --log for its --log-dir
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd + list(args) + ["--log-file", log], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, read_log(log))


def assert_same_losses(run, reference, atol=1e-4):
    """The equivalence contract: the same per-step loss as the baseline, within atol, every step."""
    assert run.returncode == 0, run.stderr[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
    got, want = run.losses(), reference.losses()
    assert len(got) == len(want) > 0, (len(got), len(want))
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= atol, f"largest |loss - baseline loss| = {worst:.3g} > {atol}"
    return worst


def assert_one_error_line(parse_args, argv, world, message, monkeypatch, capsys):
    """Bad input, checked where every rank checks it: parse_args(argv) at this WORLD_SIZE (what torchrun
    tells each rank; parsing comes before any collective) exits 2 with one line starting with message."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err


def _rank_main(rank, world, init_file, module, name):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))   # as torchrun would: parse_args reads them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    getattr(importlib.import_module(module), name)(rank, world, dist.group.WORLD)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see mp.dist.exit_now: skip the C++ teardown that may abort on gloo


def run_ranks(case, world, tmp_path):
    """Run case(rank, world, group), a module-level function, on `world` spawned gloo ranks; an
    assertion on any rank fails the test."""
    mp.spawn(_rank_main, args=(world, str(tmp_path / "rendezvous"), case.__module__, case.__name__), nprocs=world)
