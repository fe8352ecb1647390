"""Faults and launches: a dead rank, a hung rank, two torchrun agents as two nodes on loopback."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import FAST, ROOT, launch, read_log
from mp.log import newest_log   # a running program's log is its partial file (mp/log.py)

pytestmark = pytest.mark.slow   # each waits for a real torchrun through a fault: 7-15 s

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


def start_and_wait_for_steps(tmp_path, extra, steps_seen=2, program="pipeline_microbatch.py", args=PIPELINE):
    log = str(tmp_path / "fault.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "--",
           os.path.join(ROOT, program)] + args + ["--steps", "100000", "--log-file", log] + extra
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while sum(r["event"] == "train" for r in read_log(newest_log(log) or log)) < steps_seen:
        assert time.time() < deadline and proc.poll() is None, "the run did not start"
        time.sleep(0.2)
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


@pytest.mark.parametrize("program,args,waited", [
    ("pipeline_microbatch.py", PIPELINE, f"({P2P_WAIT}|{NORM_WAIT}|{LOG_WAIT})"),
    ("tensor_parallel.py", FAST + ["--model", "mlp", "--hidden", "32"],
     r"error: rank \d waited for the tensor-parallel collectives of step \d+, "),
    ("pipeline_dp_joint.py", PIPELINE + ["--dp", "2", "--batch-size", "24", "--microbatches", "2"],
     f"({P2P_WAIT}|{DP_WAIT}|{NORM_WAIT}|{LOG_WAIT})")],
    ids=["pipeline", "tensor-parallel", "joint"])
def test_a_hung_rank_makes_the_others_fail_after_the_timeout_naming_the_wait(tmp_path, program, args, waited):
    proc, log = start_and_wait_for_steps(tmp_path, ["--timeout-s", str(GIVE_UP_S)], program=program, args=args)
    stopped = ranks_of(log)[2]
    os.kill(stopped, signal.SIGSTOP)
    deadline = time.time() + 40
    while set(ranks_of(log)) - {2} and time.time() < deadline:
        time.sleep(0.2)
    assert not set(ranks_of(log)) - {2}, "the other ranks must give up once --timeout-s has passed"
    os.kill(stopped, signal.SIGKILL)  # torchrun's SIGTERM cannot wake a stopped process: it kills it 30 s later
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert re.search(waited + rf"and gave up \(timeout {GIVE_UP_S} s\)", err), err[-3000:]
    assert err.count("Traceback (most recent call last)") <= 1, err[-3000:]   # torchrun's own, none of ours
    assert ranks_of(log) == {}
    assert read_log(newest_log(log))


def test_a_stopped_pipeline_leaves_its_data_parallel_peers_waiting_no_longer_than_the_timeout(tmp_path):
    """Pipeline 1 (ranks 2 and 3) stops whole: pipeline 0 then waits in the data-parallel all-reduce,
    on groups made by new_group, whose own default timeout is 30 minutes. They take --timeout-s."""
    args = PIPELINE + ["--dp", "2", "--batch-size", "24", "--microbatches", "2"]
    proc, log = start_and_wait_for_steps(tmp_path, ["--timeout-s", str(GIVE_UP_S)], program="pipeline_dp_joint.py",
                                         args=args)
    stopped = [ranks_of(log)[r] for r in (2, 3)]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.time() + 40
    while set(ranks_of(log)) - {2, 3} and time.time() < deadline:
        time.sleep(0.2)
    assert not set(ranks_of(log)) - {2, 3}, "pipeline 0 must give up once --timeout-s has passed"
    for pid in stopped:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    # both waits are on the data-parallel group: the gradients' all-reduce, or (when the stop lands at the
    # end of a logged step; seen under load) the logged losses' average over the replicas
    assert re.search(f"({DP_WAIT}|{LOG_WAIT})" + rf"and gave up \(timeout {GIVE_UP_S} s\)", err), err[-3000:]
