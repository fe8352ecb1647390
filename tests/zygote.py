"""The tests' quick python and torchrun: one process imports torch once, and every rank of every launch
is forked from it.

Most of a short test run used to be start-up: each rank of each launch imported torch, and the first
optimizer pulls in torch._dynamo (about 2 s a rank on 2 cores, more than the run itself). This server
does the imports once and listens on a Unix socket. A launch (from tests/helpers.py, or from
tests/python, the stand-in for $PYTHON that the launchers' tests use) sends its command, working
folder, environment and its stdout/stderr; a session forked for it forks the ranks, which write to
those same files, and answers with their exit statuses. For several ranks it does what
`torchrun --standalone` does: a store for the ranks in a process of its own (as torchrun's agent),
each rank's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT and TORCHELASTIC_* variables, and when
one rank fails it stops the others and exits 1. When the client goes away (a test's timeout, Ctrl-C)
the ranks are stopped.

What it cannot stand in for goes to the real interpreter: torchrun with other options
(--max-restarts, --nnodes), signals sent to a launcher's process group. `TESTS_LAUNCHER=torchrun`
sends every launch through the real python and torchrun (the same tests, slower).

A forked rank is made to look like a fresh interpreter where it can be: `random` and numpy's global
generator are seeded anew in each rank (from the OS, as a new process seeds them), tests/ is not on a
program's sys.path (only a test's own function, run_ranks, imports from there), and after a failure
the other ranks get torchrun's grace. What cannot be made equal: every rank shares the server's
string hash seed (PYTHONHASHSEED is read once, at start-up), so code that orders collectives by
iterating a set of strings would agree across ranks here and not under torchrun; the modules the
server imported are imported already; and the ranks start within milliseconds of each other."""
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback

GRACE_S = 30  # after a rank fails: how long the others get after SIGTERM before SIGKILL (torchrun's agent: 30 s)
TESTS = os.path.dirname(os.path.abspath(__file__))


def die_with_parent():
    """Ask Linux to SIGKILL this process when its parent ends, so that no rank, session or server
    outlives the test run that started it (pytest killed, a session killed on a timeout)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)    # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                                        # not Linux: the fixture still kills the server


def preload():
    """Import what every rank imports. It must leave this process with one thread: fork copies only
    the calling thread, so a lock another thread held would stay locked forever in every rank."""
    os.environ["OMP_NUM_THREADS"] = "1"     # else numpy's BLAS starts its thread pool on import
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the optimizers import it: ~0.7 s)
    import torch.distributed  # noqa: F401
    try:
        import torchvision  # noqa: F401  (the CIFAR-10 tests)
        import matplotlib   # the launchers' plots, drawn as mp/tools/plot_curves.py draws them
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass
    # every object made so far out of the collector's sight: a rank's first full collection would else
    # write to the header of each of the imports' objects, copying nearly every page fork shares
    gc.collect()
    gc.freeze()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    assert threads == 1, f"tests/zygote.py: {threads} threads after the imports; forking them is unsafe"


# --- in a rank ---------------------------------------------------------------------------------

def _fresh_interpreter():
    """What a new process would have that the fork copied from the server: its own random state (random
    and numpy seeded from the OS), and a sys.path without tests/ (the server started as tests/zygote.py)."""
    import random
    import numpy
    random.seed()                 # Python reseeds it after a fork already; numpy does not
    numpy.random.seed()
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != TESTS]


def _python_startup(env):
    """What a new interpreter does with this environment's PYTHONPATH: its entries go on sys.path, and a
    sitecustomize.py among them runs (tests/mirror_site patches torchvision's CIFAR10 that way)."""
    for entry in [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and e not in sys.path]:
        sys.path.insert(1, entry)
        if os.path.exists(os.path.join(entry, "sitecustomize.py")):
            runpy.run_path(os.path.join(entry, "sitecustomize.py"))


def _call(request, rank):
    """A test's function on a gloo group of all ranks (what tests/helpers.run_ranks asks for)."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{request['init_file']}", rank=rank,
                            world_size=request["nproc"])
    getattr(importlib.import_module(request["module"]), request["name"])(rank, request["nproc"], dist.group.WORLD)
    dist.destroy_process_group()


def _run(request, rank):
    """As `python script args`, `python -m module args`, `python -c code args`, or a test's function."""
    kind, argv = request["kind"], request.get("argv", [])
    if kind == "call":
        return _call(request, rank)
    if kind == "script":
        sys.argv, sys.path[0] = [request["script"]] + argv, os.path.dirname(request["script"])
        runpy.run_path(request["script"], run_name="__main__")
    elif kind == "module":
        sys.argv, sys.path[0] = [request["module"]] + argv, os.getcwd()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    elif kind == "code":
        sys.argv, sys.path[0] = ["-c"] + argv, ""
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})


def _exit_status(e):
    """What `python ...` returns for SystemExit(e.code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _rank(request, rank, env, fds):
    """The forked rank: never returns."""
    status = 1
    try:
        die_with_parent()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)   # line-buffered: ranks share them
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        _fresh_interpreter()
        _python_startup(env)
        _run(request, rank)
        status = 0
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException:  # noqa: BLE001 (as python prints an uncaught exception)
        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


# --- in a session (one launch) ------------------------------------------------------------------

def _store_host():
    """torchrun's agent hosts the ranks' store; here a forked process does (a store runs threads, which
    this server must not). Returns (pid, port)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        die_with_parent()
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(write, str(store.port).encode())
        while True:
            signal.pause()
    port = int(os.read(read, 16))
    os.close(read), os.close(write)
    return pid, port


def torchrun_envs(nproc, port, base):
    """What torchrun --standalone tells each of nproc ranks on one node."""
    return [dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                 GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(nproc),
                 ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                 TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"))
            for r in range(nproc)]


def _stop(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(pids, timeout, conn):
    """Wait for every rank; a failed rank stops the others (SIGTERM, then SIGKILL), so does the
    client hanging up. Returns ({pid: status}, timed_out)."""
    codes, deadline, kill_at, timed_out = {}, time.monotonic() + timeout, None, False
    while len(codes) < len(pids):
        for pid in [p for p in pids if p not in codes]:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        live = [p for p in pids if p not in codes]
        hung_up = bool(select.select([conn], [], [], 0.005)[0])      # readable only at the client's EOF
        if hung_up:
            time.sleep(0.005)
        if (hung_up or any(c != 0 for c in codes.values())) and kill_at is None and live:
            _stop(live, signal.SIGTERM)
            kill_at = time.monotonic() + GRACE_S
        if time.monotonic() > deadline and live:
            timed_out = True
            _stop(live, signal.SIGKILL)
        elif kill_at is not None and time.monotonic() > kill_at:
            _stop(live, signal.SIGKILL)
    return codes, timed_out


def _session(conn):
    """One launch: read the request and the client's stdout/stderr, fork the ranks, answer."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 2)
    while not message.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            return
        message += chunk
    request = json.loads(message)
    nproc, env, store = request["nproc"], request["env"], None
    envs = [env]
    if request.get("torchrun"):
        store = _store_host()
        envs = torchrun_envs(nproc, store[1], env)
    elif nproc > 1:
        envs = [dict(env, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r)) for r in range(nproc)]
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(request, rank, envs[rank], fds)
        pids.append(pid)
    statuses, timed_out = _wait(pids, request.get("timeout", 600), conn)
    if store:
        _stop([store[0]], signal.SIGKILL)
        os.waitpid(store[0], 0)
    codes = [statuses[p] for p in pids]
    conn.sendall((json.dumps({"codes": codes, "timed_out": timed_out}) + "\n").encode())


# --- the client ---------------------------------------------------------------------------------

def ask(request, stdout_fd, stderr_fd):
    """Run a request on the server at $TESTS_ZYGOTE, the ranks writing to these two files; returns
    the reply: {"codes": [exit status of each rank, -N if killed by signal N], "timed_out": bool}."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(os.environ["TESTS_ZYGOTE"])
        socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [stdout_fd, stderr_fd])
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(1 << 16)
            if not chunk:
                raise RuntimeError("tests/zygote.py ended a launch without an answer")
            reply += chunk
    return json.loads(reply)


def torchrun_status(codes):
    """torchrun's own exit status: 0 when every rank succeeded, else 1."""
    return 0 if all(c == 0 for c in codes) else 1


# --- the server ----------------------------------------------------------------------------------

def main(path):
    die_with_parent()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:              # a session per launch: launches may overlap
            server.close()
            try:
                die_with_parent()
                _session(conn)
            finally:
                os._exit(0)
        conn.close()
        while True:                     # reap finished sessions
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


if __name__ == "__main__":
    main(sys.argv[1])
