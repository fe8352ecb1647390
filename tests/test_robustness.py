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


# ---- no rank outlives its launcher (issue 85, item 1) --------------------------------------------

def running(pid):
    """Whether pid runs (a zombie, ended but not reaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid):
    """Every process below pid, read from /proc's parent links."""
    children = {}
    for other in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{other}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(other))
        except OSError:
            continue
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def gone_within(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if running(pid)]


# a parent that starts one rank of a 2-rank torchrun job as torchrun's agent would, says its pid, and waits
# (or, "dies first", leaves at once: the rank has not yet asked to end with it)
RANK_PARENT = """import os, subprocess, sys
env = dict(os.environ, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
           MASTER_PORT=sys.argv[1], TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS="1")
if sys.argv[2] != "plain torchrun":
    env["MP_LAUNCHER_PID"] = str(os.getpid())
rank = subprocess.Popen([sys.executable, "-u", "tensor_parallel.py", *sys.argv[4:]], env=env, start_new_session=True)
print(rank.pid, flush=True)
os._exit(0) if sys.argv[3] == "dies first" else rank.wait()
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("launcher", ["plain torchrun", "mp.tools.torchrun"])
def test_a_rank_whose_launcher_is_killed_ends_at_once(tmp_path, launcher):
    """The issue's rank: its agent gone, it waited in the connect to the agent's store, a C++ wait that a
    Ctrl-C cannot interrupt, for minutes. Here the store is a socket that never answers: once the rank
    has connected to it, its parent is killed with SIGKILL, and the rank ends within seconds."""
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen(1)
        store.settimeout(120)
        parent = subprocess.Popen([sys.executable, "-c", RANK_PARENT, str(store.getsockname()[1]), launcher,
                                   "waits", *FAST, "--model", "mlp", "--timeout-s", "300"], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        rank = int(parent.stdout.readline())
        try:
            conn, _ = store.accept()     # the rank is in the store's connect
            parent.kill()
            parent.wait()
            assert gone_within([rank], 10) == [], "the rank outlived its killed parent"
            conn.close()
        finally:
            if running(rank):
                os.kill(rank, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_rank_whose_launcher_ended_before_it_started_ends_too(tmp_path):
    """The launcher gone before the rank's request to end with it could take effect (killed while the
    rank's python started): the rank sees that its launcher (MP_LAUNCHER_PID) has gone, and ends."""
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen(1)
        parent = subprocess.run([sys.executable, "-c", RANK_PARENT, str(store.getsockname()[1]), "mp.tools.torchrun",
                                 "dies first", *FAST, "--model", "mlp", "--timeout-s", "300"], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True, timeout=60)
        rank = int(parent.stdout)
        try:
            assert gone_within([rank], 60) == [], "the rank outlived the parent that died before it asked"
        finally:
            if running(rank):
                os.kill(rank, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("fork", ["1", "0"])
def test_no_rank_outlives_a_killed_torchrun_agent(tmp_path, fork):
    """mp.tools.torchrun killed with SIGKILL mid-run (nothing can stop its ranks then): every process it
    started, forked ranks (a keeper and the program each) or new pythons, ends within seconds."""
    log = str(tmp_path / "tp.jsonl")
    agent = subprocess.Popen([sys.executable, "-m", "mp.tools.torchrun", "--standalone", "--nproc-per-node", "2",
                              "--", "tensor_parallel.py", *FAST, "--model", "mlp", "--hidden", "16",
                              "--steps", "100000", "--log-file", log], cwd=ROOT,
                             env=dict(os.environ, OMP_NUM_THREADS="1", MP_TORCHRUN_FORK=fork),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    below = []
    try:
        wait_for_steps(agent, log, 1)
        below = descendants(agent.pid)
        assert len(below) >= 2, below
        agent.kill()
        agent.wait()
        assert gone_within(below, 10) == [], "processes outlived their killed torchrun agent"
    finally:
        agent.kill()
        for pid in filter(running, below):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_rank_in_a_cpp_wait_takes_a_ctrl_c_at_once(tmp_path):
    """Python runs a signal handler only between bytecodes: a rank waiting in the connect to torchrun's
    store (C++) heard torchrun's SIGINT only when torchrun killed it 30 s later. Now: exit 130 at once."""
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen(1)
        store.settimeout(120)
        env = dict(os.environ, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.getsockname()[1]), TORCHELASTIC_RUN_ID="none",
                   TORCHELASTIC_RESTART_COUNT="0")
        rank = subprocess.Popen([sys.executable, "-u", "tensor_parallel.py", *FAST, "--model", "mlp", "--timeout-s",
                                 "300"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        conn, _ = store.accept()      # the rank is in the store's connect
        rank.send_signal(signal.SIGINT)
        try:
            out, err = rank.communicate(timeout=10)
        finally:
            rank.kill()
            conn.close()
        assert rank.returncode == 130 and out + err == "", (rank.returncode, out, err)
