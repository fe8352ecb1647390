"""The zygote (tests/zygote.py) forks every rank from one process; these runs go through the real
python and torchrun instead, so that it is never the only witness (issue 43): each of the five
programs once, its per-step losses against the baseline's (itself run by the real python)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import FAST, ROOT, assert_same_losses, launch, read_log

ARGS = FAST + ["--steps", "3", "--dropout", "0.1", "--clip-grad-norm", "0.5"]
RUNS = [   # program, ranks, its own flags
    ("pipeline_microbatch.py", 2, ["--schedule", "zb"]),
    ("pipeline_dp_joint.py", 4, ["--dp", "2", "--microbatches", "2", "--batch-size", "64"]),
    ("tensor_parallel.py", 2, []),
    ("parallel_3d.py", 4, ["--dp", "1", "--tp", "2", "--microbatches", "2"]),
]


@pytest.fixture(scope="module")
def real_baseline(tmp_path_factory):
    run = launch("single_baseline.py", ARGS, tmp_path_factory.mktemp("real-baseline"), real=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("program,nproc,flags", RUNS, ids=[r[0] for r in RUNS])
def test_each_program_under_the_real_torchrun_gives_the_baselines_losses(program, nproc, flags, tmp_path,
                                                                        real_baseline):
    run = launch(program, ARGS + flags, tmp_path, nproc=nproc, real=True)
    assert_same_losses(run, real_baseline)


# --- the launchers' torchrun (mp/tools/torchrun.py): ranks forked from its agent -------------------

PROBE = """import json, os, signal, sys, time
had_torch = "torch" in sys.modules
import numpy
rank = os.environ["RANK"]
seen = dict(rank=rank, local_rank=os.environ["LOCAL_RANK"], world=os.environ["WORLD_SIZE"],
            master=bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")),
            restart=os.environ["TORCHELASTIC_RESTART_COUNT"], name=__name__, argv=sys.argv[1:], path0=sys.path[0],
            own_session=os.getsid(0) == os.getpid(), sigint=signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            sigterm=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, unbuffered=type(sys.stdout.buffer).__name__,
            numpy_draw=int(numpy.random.randint(1 << 30)), had_torch=had_torch)
os.write(1, (json.dumps(seen) + "\\n").encode())   # one write: print's two (text, then newline) can interleave
if "--fail" in sys.argv and rank == "1":
    print("error: rank 1 refuses --fail", file=sys.stderr)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "failed_at"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(2)
"""


def wrapper(args, **env):
    """The launchers' torchrun (python -m mp.tools.torchrun) on 2 ranks, run to its end."""
    cmd = [sys.executable, "-m", "mp.tools.torchrun", "--standalone", "--nproc-per-node", "2", "--"] + args
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **env), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_the_launchers_torchrun_forks_ranks_that_look_like_new_pythons(tmp_path):
    """Without a GPU, python -m mp.tools.torchrun forks each rank from an agent that has imported torch:
    each still has its own RANK and environment, runs as __main__ with its argv, in a session of its own,
    with python's default signal handlers, unbuffered output and its own numpy seed, as the new python
    that MP_TORCHRUN_FORK=0 starts does; a rank's error line and status 2 are the last word, and the rank
    that had finished does not hold the agent for torchrun's 30 s grace."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    seen = {}
    for fork in ("1", "0"):
        run = wrapper([str(probe), "--x", "1"], MP_TORCHRUN_FORK=fork)
        assert run.returncode == 0 and not run.stderr, run.stderr[-2000:]
        seen[fork] = sorted((json.loads(line) for line in run.stdout.splitlines()), key=lambda s: s["rank"])
    forked, fresh = seen["1"], seen["0"]
    assert [s["had_torch"] for s in forked] == [True, True] and [s["had_torch"] for s in fresh] == [False, False]
    assert forked[0]["numpy_draw"] != forked[1]["numpy_draw"]
    for s in forked + fresh:
        del s["had_torch"], s["numpy_draw"]
    assert forked == fresh and [s["rank"] for s in forked] == ["0", "1"], (forked, fresh)
    assert forked[1] == dict(rank="1", local_rank="1", world="2", master=True, restart="0", name="__main__",
                             argv=["--x", "1"], path0=str(tmp_path), own_session=True, sigint=True, sigterm=True,
                             unbuffered="FileIO")
    run = wrapper([str(probe), "--fail"])
    # from rank 1's end to the agent's (the whole run took 22.7 s once, under the suite's load: start-up)
    held = time.time() - float((tmp_path / "failed_at").read_text())
    assert run.returncode == 2 and run.stderr.splitlines() == ["error: rank 1 refuses --fail"], run.stderr
    assert held < 20, f"the agent ended {held:.1f} s after rank 1 failed: the finished rank 0 held it"


CROSSING = """import os, signal, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
os.kill(os.getppid(), signal.SIGTERM)          # the agent stops this rank's keeper ...
deadline = time.monotonic() + 10
while signal.SIGTERM not in signal.sigpending() and time.monotonic() < deadline:
    time.sleep(0.01)
os._exit(0)                                    # ... just as the program ends well, the keeper's SIGTERM unseen
"""


def test_a_keeper_whose_program_ends_well_as_the_agent_stops_it_ends_by_the_signal(tmp_path):
    """The agent stops the ranks still running when one fails (SIGTERM, then SIGKILL 30 s later). A
    keeper whose program ended well as the SIGTERM came passed it on to a program already ending: had
    it then returned, it would have waited for the agent's word that never comes, and the agent its 30 s
    (CI: 41.9 s for a run of 2 s). It ends by the signal it was sent."""
    script = tmp_path / "crossing.py"
    script.write_text(CROSSING)
    keeper = ("import sys; from mp.tools.forked_rank import keep; keep(sys.argv[1], []); "
              "print('the keeper returned')")
    run = subprocess.run([sys.executable, "-c", keeper, str(script)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == -signal.SIGTERM and "returned" not in run.stdout, (run.returncode, run.stdout, run.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("program,nproc,flags", [RUNS[0], RUNS[2]], ids=["pipeline_microbatch.py", "tensor_parallel.py"])
def test_programs_in_forked_ranks_give_the_baselines_losses(program, nproc, flags, tmp_path, real_baseline):
    """The same programs in ranks forked by the launchers' torchrun (tensor_parallel.py ends with
    os._exit, which a forked rank must turn into torchrun's success)."""
    log = str(tmp_path / "forked.jsonl")
    run = wrapper([program] + ARGS + flags + ["--log-file", log])
    assert run.returncode == 0, run.stderr[-3000:]
    got = [r["loss"] for r in read_log(log) if r["event"] == "train"]
    assert got and max(abs(a - b) for a, b in zip(got, real_baseline.losses())) <= 1e-4


@pytest.mark.slow
def test_under_plain_torchrun_a_refusal_ends_the_output(tmp_path):
    """Issue 59: plain torchrun (as the programs' docstrings launch them) prints a report of every
    failed rank after our one `error:` line, tens of lines. Each rank leaves the line in the file
    torchrun names (TORCHELASTIC_ERROR_FILE, mp.errors.tell_torchrun), so the report's Root Cause,
    which ends the output, shows it in place of a link to torch's docs."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--",
                           os.path.join(ROOT, "pipeline_microbatch.py"), "--data", "synthetic", "--shedule", "1f1b"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = "error: unrecognized arguments: --shedule 1f1b: did you mean --schedule? (see --help)"
    assert proc.returncode != 0 and proc.stderr.count(line) >= 2, proc.stderr[-3000:]   # the console's, the report's
    tail = proc.stderr.strip().splitlines()[-10:]
    assert any(t.startswith("Root Cause") for t in tail) and f"traceback : {line}" in [t.strip() for t in tail], tail
    assert "To enable traceback" not in proc.stderr, proc.stderr[-3000:]
