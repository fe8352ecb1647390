"""run_slurm.sh on a real Slurm cluster: the test brings one up on this machine, one slurmctld and two
slurmd (nodes n1 at 127.0.0.1 and n2 at 127.0.0.2, each in a UTS namespace whose host name is its
address), with munge for authentication; config, state, logs and key live in a temporary directory
and every daemon is stopped at the end. docs/slurm.md explains the config line by line."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import PYTHON, ROOT, Run, read_log, written

INSTALL = "apt-get install slurmctld slurmd slurm-client munge (.ci/run does it)"
TOOLS = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel", "unshare"]
NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2"}
PARTITION = "loop"


def tool(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def slurm_conf(top, ports):
    """Everything in `top`; every daemon binds a loopback address only (NoInAddrAny: the address of
    its host name, which the namespace made 127.0.0.x)."""
    nodes = "\n".join(f"NodeName={name} NodeAddr={addr} Port={ports[name]} CPUs={os.cpu_count()} State=UNKNOWN"
                      for name, addr in NODES.items())
    return f"""\
ClusterName=loopback
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={top}/munge/munge.socket
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={top}/state
SlurmdSpoolDir={top}/spool/%n
SlurmctldPidFile={top}/slurmctld.pid
SlurmdPidFile={top}/slurmd-%n.pid
SlurmctldLogFile={top}/log/slurmctld.log
SlurmdLogFile={top}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=4
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=10 State=UP
"""


class Cluster:
    def __init__(self, top):
        self.top = str(top)
        self.conf = os.path.join(self.top, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.daemons = []   # Popen, in start order
        self.up_s = None

    def start(self, name, cmd):
        out = open(os.path.join(self.top, "log", f"{name}.out"), "w")
        self.daemons.append(subprocess.Popen(cmd, cwd=self.top, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True))
        out.close()

    def run(self, *cmd, timeout=30):
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self, chars=1500):
        """The tail of every daemon's log, for a failure message."""
        tails = []
        for name in sorted(os.listdir(os.path.join(self.top, "log"))):
            with open(os.path.join(self.top, "log", name), errors="replace") as f:
                tails.append(f"--- {name}\n{f.read()[-chars:]}")
        return "\n".join(tails)

    def wait_until(self, ready, what, timeout):
        deadline = time.time() + timeout
        while not ready():
            dead = [d.args for d in self.daemons if d.poll() is not None]
            assert not dead and time.time() < deadline, f"{what}: not after {timeout} s (exited: {dead})\n{self.logs()}"
            time.sleep(0.1)

    def up(self):
        t0 = time.time()
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.top, sub))
        os.chmod(os.path.join(self.top, "munge"), 0o755)   # munged wants its socket's folder open to all
        key = os.path.join(self.top, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        ports = {"ctld": free_port("127.0.0.1"), **{name: free_port(addr) for name, addr in NODES.items()}}
        with open(self.conf, "w") as f:
            f.write(slurm_conf(self.top, ports))
        munge = os.path.join(self.top, "munge")
        # -f: the temporary folder's parents are not open to all, as munged would like; all runs as root
        self.start("munged", [tool("munged"), "-F", "-f", f"--socket={munge}/munge.socket", f"--key-file={key}",
                              f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                              f"--seed-file={munge}/munged.seed"])
        self.wait_until(lambda: os.path.exists(f"{munge}/munge.socket"), "munged's socket", 15)
        self.start("slurmctld", [tool("slurmctld"), "-D", "-i", "-f", self.conf])
        for name, addr in NODES.items():
            # a host name of its own, its address: slurmd binds there, and every task sees it as `hostname`
            self.start(f"slurmd-{name}", [tool("unshare"), "--uts", "sh", "-c",
                                          f'hostname {addr} && exec "$0" -D -f "$1" -N {name}',
                                          tool("slurmd"), self.conf])
        self.wait_until(self.idle, "both nodes idle in sinfo", 30)
        self.up_s = time.time() - t0

    def idle(self):
        states = self.run(tool("sinfo"), "-h", "-N", "-o", "%N %t").stdout.split()
        return states == ["n1", "idle", "n2", "idle"]

    def down(self):
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL), then end what the jobs left:
        slurmstepd daemonizes out of slurmd's session, but its folder is this one."""
        if len(self.daemons) >= 2 and all(d.poll() is None for d in self.daemons[:2]):   # munged, slurmctld
            try:
                self.run(tool("scancel"), f"--partition={PARTITION}", timeout=20)
                deadline = time.time() + 20
                while self.run(tool("squeue"), "-h", timeout=20).stdout.strip() and time.time() < deadline:
                    time.sleep(0.5)
            except subprocess.TimeoutExpired:
                pass   # the daemons are stopped below, and what the jobs left is killed
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGTERM)
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon.pid, signal.SIGKILL)
                    daemon.wait(timeout=15)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self):
        """Processes of this cluster that outlived the daemons: run in its folder, or given its config."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            if int(pid) != os.getpid() and (cwd == self.top or cwd.startswith(self.top + "/") or
                                            f"SLURM_CONF={self.conf}".encode() in environ):
                found.append(int(pid))
        return found


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    missing = [name for name in TOOLS if not tool(name)]
    if missing:
        pytest.skip(f"Slurm is not installed here ({', '.join(missing)} not found): {INSTALL}")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons as root (SlurmUser=root, a UTS namespace per node)")
    if subprocess.run([tool("unshare"), "--uts", "true"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("unshare --uts is refused here (a container without CAP_SYS_ADMIN?): the two nodes need "
                    "a host name each")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.up()
        print(f"\nthe two-node Slurm cluster came up in {cluster.up_s:.1f} s")
        yield cluster
    finally:
        cluster.down()
    assert not cluster.leftovers(), "a process of the test cluster outlived its teardown"


def outside_slurm(tmp_path, **knobs):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), **knobs)
    return subprocess.run(["bash", os.path.join(ROOT, "run_slurm.sh")], env=env, capture_output=True, text=True,
                          timeout=60)


def test_outside_a_slurm_job_the_script_says_how_to_submit_it(tmp_path):
    run = outside_slurm(tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: run_slurm.sh runs inside a Slurm job") and "sbatch run_slurm.sh" in run.stderr


@pytest.mark.parametrize("knobs,message", [
    (dict(PROGRAM="pipeline.py"), "error: PROGRAM=pipeline.py is not one of the parallel programs: set PROGRAM to"),
    (dict(NPROC="0"), "error: NPROC=0 must be a positive integer"),
    (dict(REPO="/"), "error: cannot find pipeline_microbatch.py (REPO=/, submitted from "),
    (dict(ACTIVATION="tanh"), "error: ACTIVATION=tanh is not an activation here: set ACTIVATION=gelu or"),
    (dict(PROGRAM="tensor_parallel.py", BALANCE="auto"),
     "error: BALANCE=auto splits pipeline stages, and tensor_parallel.py has none: unset BALANCE"),
    (dict(ZERO="1"), "error: ZERO=1 splits the optimizer state over data-parallel replicas, and "
                     "pipeline_microbatch.py has none: unset ZERO"),
], ids=["program", "nproc", "repo", "activation", "balance", "zero"])
def test_bad_knobs_are_refused_before_anything_runs(tmp_path, knobs, message):
    """As inside a job (the SLURM_* variables set by hand): one error line, exit status 2, nothing written."""
    run = outside_slurm(tmp_path, SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n1", SLURM_JOB_NUM_NODES="1", **knobs)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(message), run.stderr
    assert not (tmp_path / "logs").exists()


STAND_IN_SCONTROL = """#!/bin/sh
case "$1 $2" in
    "show hostnames") echo n1 ;;
    "show node") echo "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=n1" ;;
esac
"""
# srun's own options, then the command it would start once per node: here once, on this machine
STAND_IN_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do case "$1" in --nodes|--ntasks|--ntasks-per-node|--cpus-per-task) shift 2 ;; *) shift ;; esac; done
exec "$@"
"""


def test_knobs_reach_both_programs_and_2bw_is_drawn_on_its_delay_1_reference(tmp_path):
    """The script as Slurm would run it in a one-node job, with stand-ins for scontrol and srun (no
    cluster needed: the real one is below): ACTIVATION goes to both programs, BALANCE to the
    pipeline, and SCHEDULE=2bw gets the baseline run with --delay 1, whose losses 2bw logs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", STAND_IN_SCONTROL), ("srun", STAND_IN_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    knobs = dict(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n1", SLURM_JOB_NUM_NODES="1", REPO=ROOT,
                 PATH=f"{bin_dir}:{os.environ['PATH']}", RDZV_PORT=str(free_port("127.0.0.1")), OMP_NUM_THREADS="1",
                 NPROC="2", MODEL="mlp", SCHEDULE="2bw", MICROBATCHES="2", ACTIVATION="relu", BALANCE="auto",
                 DATA="synthetic", STEPS="6", EVAL_EVERY="0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHON=PYTHON, LOGS=str(tmp_path / "logs"), **knobs)   # torchrun --nnodes: the real one
    run = subprocess.run(["bash", os.path.join(ROOT, "run_slurm.sh"), "--layers", "4"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "== baseline with --delay 1, the 2bw reference: one process on" in run.stdout
    logs = tmp_path / "logs"
    reference = read_log(logs / "slurm-7-single_baseline_mlp_delay1.jsonl")
    pipeline = read_log(logs / "slurm-7-pipeline_microbatch_mlp_n1x2.jsonl")
    assert reference[0]["args"]["delay"] == 1 and reference[0]["args"]["activation"] == "relu"
    args = pipeline[0]["args"]
    assert (args["schedule"], args["activation"], args["layers"]) == ("2bw", "relu", 4)
    assert args["balance"] and args["balance"] != "auto"   # resolved into blocks per stage
    got, want = Run(0, "", "", pipeline).losses(), Run(0, "", "", reference).losses()
    assert len(got) == len(want) == 6 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-4
    assert (logs / "plots" / "slurm-7-pipeline_microbatch_mlp_loss.png").stat().st_size > 10_000
    assert written(run.stdout) == [str(logs / name) for name in ("slurm-7-single_baseline_mlp_delay1.jsonl",
        "slurm-7-pipeline_microbatch_mlp_n1x2.jsonl", "plots/slurm-7-pipeline_microbatch_mlp_loss.png")]


def sbatch(cluster, tmp_path, args=(), timeout=300, **knobs):
    """`sbatch --wait -N 2 run_slurm.sh` from the repository's root, as a user submits it; the job's
    time limit (3 minutes) ends it inside the cluster before `timeout` ends the wait here."""
    env = dict(cluster.env, PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), DATA="synthetic", EVAL_EVERY="0",
               OMP_NUM_THREADS="1", RDZV_PORT=str(free_port("127.0.0.1")), **knobs)
    cmd = [tool("sbatch"), "--wait", "-N", "2", "--time=3", f"--output={tmp_path}/slurm-%j.out", "run_slurm.sh",
           *args]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    job = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert job, proc.stdout + proc.stderr
    with open(tmp_path / f"slurm-{job.group(1)}.out", errors="replace") as f:
        output = f.read()
    return proc.returncode, job.group(1), output, wall


def test_a_bad_argument_fails_the_job_with_the_programs_error(slurm_cluster, tmp_path):
    """Six ranks for the cnn's five blocks: the job stops at the argument check, before anything trains,
    and sbatch --wait returns the job's exit status."""
    rc, job, output, _ = sbatch(slurm_cluster, tmp_path, NPROC="3", STEPS="2")
    assert rc == 2, output[-3000:]
    first = output.splitlines()[0]
    assert first.startswith("error: ") and "6" in first and "== baseline" not in output, output[-3000:]
    assert "run_slurm.sh: stopped: this step failed with exit status 2" in output
    assert not list((tmp_path / "logs").rglob("*.png"))


def wait_for(condition, what, timeout, poll=0.5):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what}: not after {timeout} s"
        time.sleep(poll)


@pytest.mark.slow
def test_a_requeued_job_resumes_and_finishes_with_the_uninterrupted_losses(slurm_cluster, tmp_path):
    """`sbatch --wait -N 2 run_slurm.sh` from the repository's root, as a user submits it: a pipeline on
    two nodes of two ranks, each node running a task of the job. Then `scontrol requeue` mid-run (as
    preemption does): Slurm stops the job and starts the script again; the parallel program resumes from
    its last checkpoint, and its losses are still the baseline's."""
    steps = 200    # 15-20 ms a step here: requeued at step 40, with some 160 steps (about 3 s) to spare
    env = dict(slurm_cluster.env, PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), DATA="synthetic",
               EVAL_EVERY="0", OMP_NUM_THREADS="1", RDZV_PORT=str(free_port("127.0.0.1")), NPROC="2",
               PROGRAM="pipeline_microbatch.py", STEPS=str(steps), CHECKPOINT_DIR=str(tmp_path / "ckpt"),
               SAVE_EVERY="20")
    cmd = [tool("sbatch"), "--wait", "--requeue", "--open-mode=append", "-N", "2", "--time=6",
           f"--output={tmp_path}/slurm-%j.out", "run_slurm.sh"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = tmp_path / "logs"
    try:
        trained = lambda: [r for log in logs.glob("slurm-*-pipeline_microbatch_*.jsonl") for r in read_log(log)
                           if r["event"] == "train"]
        wait_for(lambda: len(trained()) >= 40 or proc.poll() is not None, "the pipeline's step 40", 180)
        assert proc.poll() is None, proc.communicate()
        log = next(logs.glob("slurm-*-pipeline_microbatch_*.jsonl"))
        job = re.match(r"slurm-(\d+)-", log.name).group(1)
        assert slurm_cluster.run(tool("scontrol"), "requeue", job).returncode == 0
        # a requeued job waits two minutes (its BeginTime) before it may start again: not here
        state = lambda: slurm_cluster.run(tool("squeue"), "-h", "-j", job, "-o", "%T").stdout.strip()
        wait_for(lambda: state() == "PENDING", "the requeued job pending", 60)
        assert slurm_cluster.run(tool("scontrol"), "update", f"JobId={job}", "StartTime=now").returncode == 0
        proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    output = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert proc.returncode == 0, f"job {job} failed:\n{output[-3000:]}\n{slurm_cluster.logs()}"
    assert "== pipeline_microbatch: 2 nodes x 2 ranks = 4 ranks; rendezvous 127.0.0.1:" in output
    # both nodes ran a task of the job's step 0 (torchrun's rendezvous also waits for both agents)
    for node in NODES:
        with open(os.path.join(slurm_cluster.top, "log", f"slurmd-{node}.log")) as f:
            assert f"StepId={job}.0" in f.read(), f"node {node} ran no task of step {job}.0"
    assert (logs / "plots" / f"slurm-{job}-pipeline_microbatch_cnn_loss.png").stat().st_size > 10_000   # the job's own
    assert output.count("== baseline") == 2, "the job did not run twice"
    assert "== baseline: finished before the requeue, not run again" in output   # its complete log is kept
    final = logs / re.sub(r"\.partial-\d+(?=\.jsonl$)", "", log.name)    # log: the first attempt's partial file
    assert not list(logs.glob("*.partial-*")), "the resumed run's complete log leaves no partial one behind"
    records = read_log(final)
    resumes = [r for r in records if r["event"] == "resume"]
    assert resumes and resumes[-1]["step"] > 0, "the requeued run did not resume from a checkpoint"
    assert records[0]["world_size"] == 4 and records[0]["args"]["steps"] == steps
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "train"}      # the resumed run's, last
    baseline = Run(0, "", "", read_log(logs / f"slurm-{job}-single_baseline_cnn.jsonl")).losses()
    assert len(baseline) == steps and set(range(resumes[-1]["step"], steps)) <= set(losses)
    worst = max(abs(losses[k] - baseline[k]) for k in losses)
    assert worst <= 1e-4, f"largest |loss - baseline loss| = {worst:.3g} > 1e-4"
