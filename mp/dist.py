"""The torchrun environment, the process group and its teardown, and the bounded waits: a
communication failure becomes one `error:` line naming what was awaited, never a hang."""
import ctypes
import datetime
import os
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp.errors import CommError, fail, print_error


@dataclass
class Env:
    """Who this process is under torchrun (a plain `python prog.py` is rank 0 of 1)."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    timeout_s: float = None     # --timeout-s: how long a read after collectives may wait (settle)


def torchrun_env(backend="auto"):
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = 0 < gpus < local_world and gpus_can_be_shared()   # several local ranks a GPU (NCCL 2.30+)
    if backend == "auto":  # nccl when each local rank has a GPU, its own or a shared one; else gloo on the CPU
        backend = "nccl" if gpus >= local_world or shared else "gloo"
    if backend == "nccl" and gpus < local_world and not shared:
        fail(f"--backend nccl needs one GPU per local rank: {local_world} local ranks, {gpus} GPUs (ranks share a "
             f"GPU only with NCCL 2.30 or later and {SHARE_SWITCH}=1: {sharing_state()}); use --backend gloo, "
             f"fewer processes per node, or a torch whose NCCL is 2.30+ with the switch (docs/gpu.md)")
    if backend == "nccl" and world > 1 and "LOCAL_RANK" not in os.environ:
        fail(f"--backend nccl at world size {world} needs LOCAL_RANK (which GPU is mine), which this "
             f"launcher did not set: every rank would use cuda:0; launch with torchrun, or set LOCAL_RANK")
    if backend == "nccl" and shared and local_rank == 0:
        print(f"note: {local_world} local ranks share {gpus} GPU{'s' if gpus > 1 else ''} (rank r on cuda:r % "
              f"{gpus}; {sharing_state()}): right for checking results, not for timing them, since the ranks "
              f"share the GPU's cores", flush=True)
    device = torch.device(f"cuda:{local_rank % gpus}") if backend == "nccl" else torch.device("cpu")
    return Env(rank, world, local_rank, local_world, backend, device)


SHARE_SWITCH = "NCCL_MULTI_RANK_GPU_ENABLE"   # NCCL's own switch (experimental in 2.30) for ranks sharing a GPU


def gpus_can_be_shared():
    """May several nccl ranks share one GPU here? NCCL allows it from 2.30 on, when asked by its switch.
    The version is the loaded library's (loaded_nccl_version), not the one torch was built with."""
    version = loaded_nccl_version()
    return os.environ.get(SHARE_SWITCH) == "1" and version is not None and version >= (2, 30, 0)


def sharing_state():
    """What decides sharing, as found: `NCCL 2.30.7 loaded, NCCL_MULTI_RANK_GPU_ENABLE=1`."""
    version = loaded_nccl_version()
    found = "no NCCL library loaded" if version is None else f"NCCL {'.'.join(map(str, version))} loaded"
    switch = os.environ.get(SHARE_SWITCH)
    return f"{found}, {SHARE_SWITCH}" + (f"={switch}" if switch is not None else " unset")


def loaded_nccl_version():
    """(major, minor, patch) of the NCCL library this process has loaded, from its ncclGetVersion; None
    where none is. Not torch.cuda.nccl.version(): that is the version torch was BUILT with, a constant,
    and a wheel's nvidia-nccl package (or LD_LIBRARY_PATH) may bring another. torch loads libnccl.so.2
    with its CUDA library, or links NCCL in (older builds: the symbol is then torch's own)."""
    for name in ("libnccl.so.2", None):
        try:
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if name else ctypes.CDLL(None)
            get_version = library.ncclGetVersion
        except (OSError, AttributeError):
            continue
        code = ctypes.c_int()
        if get_version(ctypes.byref(code)) == 0:
            major = 10000 if code.value >= 10000 else 1000   # 2.9 on: 22809 is 2.28.9; before: 2804 is 2.8.4
            return code.value // major, code.value % major // 100, code.value % 100
    return None


def agree_on_backend(env, requested, timeout_s, store=None):
    """--backend auto is decided from this node's GPU count, so nodes with different counts would
    pick different backends and hang in the first collective. On one node the choice is the same
    everywhere; across nodes the ranks compare choices on torchrun's store before any process group
    exists, and all refuse with the numbers if they differ."""
    if requested != "auto" or env.world_size == env.local_world_size:
        return
    if store is None:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            fail(f"--backend auto on {env.world_size // env.local_world_size} nodes needs torchrun (its store "
                 f"lets the nodes agree on one backend); use --backend gloo or --backend nccl")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        store = dist.PrefixStore(f"backend-auto/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    store.set(str(env.rank), env.backend)
    choices = [store.get(str(r)).decode() for r in range(env.world_size)]
    if len(set(choices)) > 1:
        nccl = [r for r, c in enumerate(choices) if c == "nccl"]
        fail(f"--backend auto chose nccl on ranks {nccl} and gloo on the others (nodes with different GPU "
             f"counts); pass --backend gloo, or --backend nccl with one GPU per local rank on every node")


def is_comm_failure(e):
    return isinstance(e, (CommError, dist.DistError)) or "gloo" in str(e)   # gloo raises plain RuntimeErrors


@contextmanager
def awaiting(what, timeout_s):
    """Name what the code inside waits for, so a timeout says it: `rank 1 waited for <what> ...`."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CommError) or not is_comm_failure(e):
            raise
        raise CommError(f"{what}, and gave up (timeout {timeout_s:g} s): {str(e).splitlines()[0][:160]}") from None


def group_timeout(env, timeout_s):
    """The process group's timeout. On nccl it arms the watchdog, which aborts the process (no
    `error:` line) once a collective has run that long; a hang inside a step should reach the loop's
    own bounded wait first (its read of the logged steps, every --log-every steps, mp.loop), which starts
    when the host gets there: hence twice the time, and a margin."""
    return datetime.timedelta(seconds=timeout_s if env.device.type != "cuda" else 2 * timeout_s + 30)


@contextmanager
def distributed(args):
    """Threads, process group with a timeout (a bug becomes an error, not a hang), teardown. A
    communication failure ends this rank with one `error:` line and exit status 1. One process
    (world size 1, `python prog.py`) gets a process group of its own too, so every collective of
    --check, --timeline and the summary runs unchanged."""
    torch.set_num_threads(args.threads)
    env = torchrun_env(args.backend)
    env.timeout_s = args.timeout_s
    agree_on_backend(env, args.backend, args.timeout_s)
    if env.device.type == "cuda":
        # no TORCH_NCCL_BLOCKING_WAIT: it would turn every wait into a CPU spin, so the host could
        # never queue work ahead of the GPU. A hang ends at the step's one bounded wait (clock).
        torch.cuda.set_device(env.device)
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                            store=process_group_store(env, args), timeout=group_timeout(env, args.timeout_s),
                            device_id=env.device if env.device.type == "cuda" else None)
    try:
        # every rank is up; and on nccl, batch_isend_irecv must not be the first collective
        with awaiting(f"rank {env.rank} waited for all {env.world_size} ranks to start", args.timeout_s):
            dist.barrier()
        yield env
    except BaseException as e:  # noqa: BLE001 (every way out must skip the teardown below)
        leave_without_teardown(e)
    dist.destroy_process_group()


def process_group_store(env, args):
    """One process: a store of its own. Under torchrun: torchrun's store, with this attempt's keys
    under a prefix of their own. torch 2.15's torchrun no longer prefixes a restarted attempt's keys
    (--max-restarts), so without it the new ranks would read the dead attempt's gloo addresses and
    hang or be refused in init_process_group."""
    if env.world_size == 1:
        return dist.HashStore()
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None    # another launcher: init_process_group's default (env://)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    return dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def leave_without_teardown(e):
    """End this rank after an exception without destroy_process_group: on nccl it drains pending
    work, so a rank that failed outside communication (or stopped with an `error:` line) would
    stall until its peers time out. A communication failure prints one `error:` line (exit 1); an
    exit keeps its status; anything else is our bug and keeps its traceback (exit 1)."""
    if isinstance(e, SystemExit):
        exit_now(e.code if isinstance(e.code, int) else 1)
    if isinstance(e, RuntimeError) and is_comm_failure(e):
        print_error(e)
    else:
        traceback.print_exception(e)
    exit_now(1)


def exit_now(status):
    """Flush and leave without running gloo's destructors, which (seen in torch 2.13) sometimes abort
    (SIGABRT, "terminate called without an active exception") after all work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def replicas_identical(params, group, device="cpu", timeout_s=None):
    """Are these parameters bit-identical on every rank of `group`? (Replicas must be: same start,
    same gradients, same update.) Each rank sends a checksum of its tensors' bits, not the tensors: a
    few numbers each in one small all-gather, then a world all-reduce so that every rank of the world,
    even those in other groups, learns the answer for all groups (a collective of every rank). A rank
    may hold none (a 3-D stage of column-parallel layers only): it sends the checksum of nothing."""
    mine = checksum(params, device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    settle(mine.device, timeout_s, lambda: "the replicas' checksums (all-gather)")   # torch.equal reads them
    same = torch.tensor([int(all(torch.equal(mine, other) for other in every))], device=mine.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    settle(mine.device, timeout_s, lambda: "the replicas' verdict (all-reduce)")
    return bool(same.item())


def checksum(params, device="cpu"):
    """[element count, sum of the bits, sum of the bits weighted by position] over the tensors' float32 bit
    patterns read as int32, in int64 (which wraps, deterministically): one flipped bit anywhere changes the
    plain sum, and two swapped elements change the weighted one."""
    sums = torch.zeros(3, dtype=torch.int64, device=device)
    start = 0
    for p in params:
        flat = p.detach().reshape(-1)
        bits = flat.view(torch.int32 if flat.element_size() == 4 else torch.uint8).to(torch.int64)
        position = torch.arange(start + 1, start + bits.numel() + 1, device=bits.device) % 1_000_003
        sums = sums.to(bits.device) + torch.stack([torch.tensor(bits.numel(), device=bits.device), bits.sum(),
                                                  (bits * position).sum()])
        start += bits.numel()
    return sums


def clock(device, timeout_s=None, awaited=lambda: "the step's queued work"):
    """perf_counter for step times; on a GPU after the queued work (the optimizer step's kernels
    included) has run, or the clock would stop while the device is still busy. That is the step's
    one CPU wait on a GPU (nccl's waits only order the streams), so it is bounded: a step that never
    finishes ends in one CommError naming awaited() after timeout_s."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        bounded_wait(done.query, timeout_s, awaited)
    return time.perf_counter()


def settle(device, timeout_s, awaited):
    """Before reading back what collectives made (a log line's sums, the summary's numbers, the replicas'
    checksums): on a GPU, wait for the work queued so far, at most timeout_s, so that a peer lost in
    those collectives gives a CommError naming awaited(), not a read blocked until nccl's watchdog
    aborts the process without a word. On the CPU gloo's own timeout bounds each collective."""
    if device.type == "cuda":
        clock(device, timeout_s, awaited)


def bounded_wait(finished, timeout_s, awaited):
    """Poll finished() until it is true; after timeout_s (None: for ever) raise a CommError."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not finished():
        if deadline is not None and time.monotonic() > deadline:
            raise CommError(f"waited {timeout_s:g} s for {awaited()} to finish on the device and gave up "
                            f"(a peer is gone or a message was never matched)")
        time.sleep(20e-6)


def one_work_per_op(works, ops):
    """What dist.batch_isend_irecv(ops) returned, as one Work per op on every backend, so that a caller
    can wait each message's own. gloo returns one Work per op. nccl runs the batch as one group call and
    returns one Work for all of it, which then stands for each op: waiting it waits the whole batch, so
    the caller waits it once (with the first receive) and counts the batch's sends as done with it."""
    return works if len(works) == len(ops) else works * len(ops)


def all_reduce_flat(tensors, group, divide_by=1, bucket_mb=16):
    """Sum each tensor over `group` in place (then divide it by divide_by): the tensors flattened into
    buckets of at most bucket_mb, one all-reduce a bucket. Flattened: each collective pays a fixed
    round trip (on gloo one all-reduce per parameter measured about 4x slower for the cnn: 8.0
    against 2.0 ms for 6 tensors, 2 ranks). Bucketed: one flat copy of every gradient would cost as
    much memory again as the gradients themselves (DDP's buckets are 25 MB for the same reason)."""
    for bucket in buckets(tensors, bucket_mb * 2**20):
        flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0]   # one: in place
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat /= divide_by
        if len(bucket) > 1:
            for t, new in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(new.view_as(t))


def buckets(tensors, max_bytes):
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor: a group of its own)."""
    groups, size = [[]], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups if groups[0] else []
