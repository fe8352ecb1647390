"""Faults and launches: a dead rank, a hung rank, two torchrun agents as two nodes on loopback."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import FAST, ROOT, launch, read_log
from mp.log import newest_log   # a running program's log is its partial file (mp/log.py)

pytestmark = pytest.mark.slow   # each waits for a real torchrun through a fault: 8-20 s

PIPELINE = FAST + ["--model", "mlp", "--hidden", "32", "--batch-size", "16", "--microbatches", "4"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_node(node_rank, port, args, log, nnodes=2, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--",
           os.path.join(ROOT, "pipeline_microbatch.py")] + args + ["--log-file", log]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_nodes_on_loopback_match_one_node(tmp_path):
    args = PIPELINE + ["--steps", "4"]
    single = launch("pipeline_microbatch.py", args, tmp_path, nproc=4)
    assert single.returncode == 0, single.stderr[-2000:]
    port, log = free_port(), str(tmp_path / "two_nodes.jsonl")
    nodes = [torchrun_node(i, port, args, log) for i in range(2)]
    for node in nodes:
        _, err = node.communicate(timeout=180)
        assert node.returncode == 0, err[-2000:]
    assert [r["loss"] for r in read_log(log) if r["event"] == "train"] == single.losses()


def ranks_of(marker):
    """{RANK: pid} of the worker processes whose command line holds marker (read from /proc)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
        except OSError:
            continue
        if marker in cmdline and "torch.distributed.run" not in cmdline and "RANK" in environ:
            found[int(environ["RANK"])] = int(pid)
    return found


def start(tmp_path, extra, program="pipeline_microbatch.py", args=PIPELINE, nproc=4):
    """A real torchrun of nproc ranks training (almost) forever, in a session of its own; (process, log)."""
    log = str(tmp_path / "fault.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--",
           os.path.join(ROOT, program)] + args + ["--steps", "100000", "--log-file", log] + extra
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, log


def wait_for_steps(proc, log, steps_seen=2):
    deadline = time.time() + 120
    while sum(r["event"] == "train" for r in read_log(newest_log(log) or log)) < steps_seen:
        assert time.time() < deadline and proc.poll() is None, "the run did not start"
        time.sleep(0.2)


def start_and_wait_for_steps(tmp_path, extra, steps_seen=2, program="pipeline_microbatch.py", args=PIPELINE):
    proc, log = start(tmp_path, extra, program, args)
    wait_for_steps(proc, log, steps_seen)
    return proc, log


GIVE_UP_S = 5   # --timeout-s of the hung-rank tests: a peer that waits this long on a stopped rank gives up


def test_a_dead_rank_takes_the_job_down_quickly(tmp_path):
    proc, log = start_and_wait_for_steps(tmp_path, ["--timeout-s", "60"])
    os.kill(ranks_of(log)[1], signal.SIGKILL)
    killed_at = time.time()
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.time() - killed_at < 30, "a dead peer must end the job within seconds, not at the timeout"
    assert ranks_of(log) == {}, "no worker may be left behind"
    assert read_log(newest_log(log))  # what was written stays, as valid JSON lines, in the partial log


# The first rank to time out wins: torchrun then stops the others, so which wait is named is a race.
P2P_WAIT = r"error: stage \d waited to (recv|send) the (activation|gradient) of microbatch \d+ (from|to) rank \d "
DP_WAIT = r"error: stage \d of pipeline \d waited for the all-reduce with its data-parallel group, ranks \[\d, \d\], "
# a stage whose backwards are done waits in the clipping norm's all-reduce over the pipeline instead
NORM_WAIT = r"error: rank \d waited for the gradient norm's sums of step \d+, "
# a rank at a log read (every --log-every steps) waits in the logged values' sums (mp.loop.finish)
LOG_WAIT = r"error: rank \d waited for the logged losses' and norms' sums, "
JOINT = PIPELINE + ["--dp", "2", "--batch-size", "24", "--microbatches", "2"]

# name: (program, its flags, ranks, the ranks stopped, the waits the error line may name); 3 ranks where
# 4 are not needed (a middle stage stopped, its neighbours on both sides waiting): each rank is a new
# python importing torch, most of these tests' time
HUNG = {
    "pipeline": ("pipeline_microbatch.py", PIPELINE, 3, (1,), f"({P2P_WAIT}|{NORM_WAIT}|{LOG_WAIT})"),
    # (or, when the stop lands between a logged step's last collective and the log read, the logged sums)
    "tensor-parallel": ("tensor_parallel.py", FAST + ["--model", "mlp", "--hidden", "32"], 2, (1,),
                        rf"(error: rank \d waited for the tensor-parallel collectives of step \d+, |{LOG_WAIT})"),
    "joint": ("pipeline_dp_joint.py", JOINT, 4, (2,), f"({P2P_WAIT}|{DP_WAIT}|{NORM_WAIT}|{LOG_WAIT})"),
    # pipeline 1 (ranks 2 and 3) stopped whole: pipeline 0 waits on the data-parallel group, the gradients'
    # all-reduce or (when the stop lands at the end of a logged step; seen under load) the logged losses' average
    "stopped pipeline": ("pipeline_dp_joint.py", JOINT, 4, (2, 3), f"({DP_WAIT}|{LOG_WAIT})"),
}


def stop_and_collect(proc, log, stopped):
    """SIGSTOP the ranks `stopped`, wait (at most 40 s) until every other rank has given up, then SIGKILL
    the stopped ones (torchrun's SIGTERM cannot wake a stopped process: it would kill it 30 s later) and
    collect torchrun's end: (ranks other than the stopped still running at the deadline, torchrun's exit
    status, its stderr, the ranks left after it, the partial log's records)."""
    pids = [ranks_of(log)[r] for r in stopped]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.time() + 40
    while set(ranks_of(log)) - set(stopped) and time.time() < deadline:
        time.sleep(0.2)
    alive = set(ranks_of(log)) - set(stopped)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    return alive, proc.returncode, err, ranks_of(log), read_log(newest_log(log))


@pytest.fixture(scope="module")
def hung_runs(tmp_path_factory):
    """The four hung-rank runs side by side, so that their waits (--timeout-s, torchrun's teardown)
    overlap: 30-40 s here against 55 s one after another (their 13 ranks' start, each importing torch,
    is most of it). Each test reads its own run's outcome; a run that went wrong raises in its own test."""
    runs = {name: start(tmp_path_factory.mktemp(name.replace(" ", "-")), ["--timeout-s", str(GIVE_UP_S)],
                        program, args, nproc) for name, (program, args, nproc, _, _) in HUNG.items()}

    def one(name):
        proc, log = runs[name]
        wait_for_steps(proc, log)
        return stop_and_collect(proc, log, HUNG[name][3])
    with ThreadPoolExecutor(len(runs)) as pool:
        outcomes = {name: pool.submit(one, name) for name in runs}
        try:
            for future in outcomes.values():
                future.exception()            # every run over before any test reads its own
        finally:
            for proc, _ in runs.values():     # none left behind, whatever failed
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
    yield outcomes


def assert_gave_up_naming_the_wait(outcome, waited):
    alive, status, err, left, records = outcome.result()
    assert not alive, "the other ranks must give up once --timeout-s has passed"
    assert status != 0
    assert re.search(waited + rf"and gave up \(timeout {GIVE_UP_S} s\)", err), err[-3000:]
    assert err.count("Traceback (most recent call last)") <= 1, err[-3000:]   # torchrun's own, none of ours
    assert left == {}, "no worker may be left behind"
    assert records                        # what was written stays, as valid JSON lines, in the partial log


@pytest.mark.parametrize("name", ["pipeline", "tensor-parallel", "joint"])
def test_a_hung_rank_makes_the_others_fail_after_the_timeout_naming_the_wait(hung_runs, name):
    assert_gave_up_naming_the_wait(hung_runs[name], HUNG[name][4])


def test_a_stopped_pipeline_leaves_its_data_parallel_peers_waiting_no_longer_than_the_timeout(hung_runs):
    """Pipeline 1 (ranks 2 and 3) stops whole: pipeline 0 then waits in the data-parallel all-reduce,
    on groups made by new_group, whose own default timeout is 30 minutes. They take --timeout-s."""
    assert_gave_up_naming_the_wait(hung_runs["stopped pipeline"], HUNG["stopped pipeline"][4])
