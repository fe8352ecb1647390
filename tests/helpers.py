"""Launch a program as a user would (python, or torchrun for several ranks) and read its log; or run
a test's function on several gloo ranks. Both go through tests/zygote.py, which forks the ranks from a
process that has imported torch once, with torchrun's environment; TESTS_LAUNCHER=torchrun sends
every launch through the real python, torchrun and torch.multiprocessing instead (slower, the same
assertions)."""
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
import torch.multiprocessing as torch_mp

import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--data", "synthetic", "--eval-every", "0", "--threads", "1"]  # what most tests add


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    records: list
    codes: list = None      # each rank's exit status, where the launch went through the zygote

    def exited(self, status):
        """Whether a rank exited with this status: the zygote's per-rank statuses, or torchrun's report."""
        if self.codes is not None:
            return status in self.codes
        return f"exitcode  : {status}" in self.stderr

    def losses(self):
        return [r["loss"] for r in self.records if r["event"] == "train"]

    def events(self, name):
        return [r for r in self.records if r["event"] == name]


def read_log(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


USE_ZYGOTE = os.environ.get("TESTS_LAUNCHER") != "torchrun"
# what the launchers' tests set PYTHON to: the zygote's stand-in, or the real interpreter
PYTHON = os.path.join(ROOT, "tests", "python") if USE_ZYGOTE else sys.executable


def start_zygote():
    """Start tests/zygote.py (conftest.py does, once per session); its socket goes in $TESTS_ZYGOTE,
    which child processes (tests/python, the launchers' $PYTHON) inherit. Returns its process."""
    path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "socket")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "zygote.py"), path],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.stdout.readline().strip() == "ready", "tests/zygote.py did not start"
    os.environ.update(TESTS_ZYGOTE=path, TESTS_REAL_PYTHON=sys.executable)
    return proc


def forked(request, cwd, timeout, env):
    """Run a request on the zygote; returns (status as python or torchrun gives it, stdout, stderr,
    each rank's status)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        reply = zygote.ask(dict(request, cwd=cwd, timeout=timeout, env=env), out.fileno(), err.fileno())
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(request.get("script", request.get("name")), timeout, stdout, stderr)
    codes = reply["codes"]
    return (zygote.torchrun_status(codes) if request.get("torchrun") else worst(codes)), stdout, stderr, codes


def worst(codes):
    """One status for several ranks: the first rank's that failed (in rank order), else 0. Whichever
    rank fails, and whenever (rank 0 may have finished cleanly long before), the launch failed."""
    return next((c for c in codes if c != 0), 0)


def launch(program, args, tmp_path, nproc=1, timeout=240, log_name=None, real=False):
    """Run `program` (a file in the repository root) with `args` as `python program` or, for nproc > 1,
    `torchrun --standalone`, on the zygote; real=True: the real python or torchrun (for a test of what
    torchrun itself prints). The log goes to tmp_path; returns a Run with its records."""
    log = os.path.join(str(tmp_path), log_name or f"{os.path.splitext(program)[0]}-{nproc}.jsonl")
    script = os.path.join(ROOT, program)
    argv = list(args) + ["--log-file", log]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not USE_ZYGOTE or real:
        cmd = [sys.executable, script] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--", script]
        proc = subprocess.run(cmd + argv, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=timeout)
        return Run(proc.returncode, proc.stdout, proc.stderr, read_log(log))
    request = {"kind": "script", "script": script, "argv": argv, "nproc": nproc, "torchrun": nproc > 1}
    code, stdout, stderr, codes = forked(request, str(tmp_path), timeout, env)
    return Run(code, stdout, stderr, read_log(log), codes)


def written(stdout):
    """The files a launcher's last lines name (`wrote:`, then one indented path a line)."""
    lines = stdout.splitlines()
    assert "wrote:" in lines, stdout[-2000:]
    return [line.strip() for line in lines[lines.index("wrote:") + 1:] if line.startswith("  ")]


def slow(*values):
    """One case of a parametrized test that `-m "not slow"` leaves out (its siblings stay in)."""
    return pytest.param(*values, marks=pytest.mark.slow)


def flags_id(value):
    """A parametrized case's id from its flags ("tp2-cp2-attention=ulysses" for ["--tp", "2", "--cp", "2",
    "--attention", "ulysses"], where pytest's own would be "layout3"); None (pytest's) for anything else."""
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return None
    parts = []
    for v in value:
        if v.startswith("--") or not parts:
            parts.append(v[2:] if v.startswith("--") else v)
        else:
            parts[-1] += v if v.replace(".", "", 1).isdigit() else f"={v}"
    return "-".join(parts)


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


GLOO_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"


def peer_lost(*args, **kwargs):
    """Stands in for a collective whose peer is gone: gloo's error, as a RuntimeError (mp.dist.awaiting
    names the wait it came from)."""
    raise RuntimeError(GLOO_LOST)


def run_ranks(case, world, tmp_path, timeout=240):
    """Run case(rank, world, group), a module-level function of a test file, on `world` gloo ranks
    (RANK, WORLD_SIZE and LOCAL_RANK set as torchrun would: parse_args reads them); an assertion on
    any rank fails the test with that rank's traceback."""
    request = {"kind": "call", "module": case.__module__, "name": case.__name__, "nproc": world,
               "init_file": str(tmp_path / "rendezvous")}
    if not USE_ZYGOTE:
        torch_mp.spawn(_spawned_rank, args=(world, request), nprocs=world)
        return
    code, stdout, stderr, codes = forked(request, str(tmp_path), timeout, dict(os.environ, OMP_NUM_THREADS="1"))
    assert code == 0, f"{case.__name__} failed on a rank (exit statuses {codes}):\n{stderr[-4000:]}"


def _spawned_rank(rank, world, request):
    """TESTS_LAUNCHER=torchrun: the same call in a rank started by torch.multiprocessing.spawn."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    zygote._call(request, rank)
    sys.stdout.flush()
    os._exit(0)  # see mp.dist.exit_now: skip the C++ teardown that may abort on gloo
