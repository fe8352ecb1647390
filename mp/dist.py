"""The torchrun environment, the process group and its teardown, and the bounded waits: a
communication failure becomes one `error:` line naming what was awaited, never a hang."""
import ctypes
import datetime
import os
import sys
import threading
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


def torchrun_env(backend="auto", store=None, timeout_s=None, environ=None):
    """Who this process is, and its backend and device. Each local rank takes GPU local_rank % (GPUs it
    sees): cuda:local_rank when every rank sees all of the node's, cuda:0 when a launcher hands each its
    own through CUDA_VISIBLE_DEVICES. Whether two local ranks share one is read from what they hold, not
    from counts: with a store (torchrun's), each writes its GPU's UUID and reads the others' (local_gpus)."""
    environ = os.environ if environ is None else environ
    rank, world = int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1))
    local_rank, local_world = int(environ.get("LOCAL_RANK", 0)), int(environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = local_rank % gpus if gpus else None                # round-robin over the GPUs this rank sees
    if store is not None and local_world > 1 and backend != "gloo":
        held = local_gpus(store, rank, local_rank, local_world, gpu_uuid(index) if gpus else "", timeout_s)
        every, distinct = "" not in held, len(set(held) - {""})
    else:   # nothing to ask (one local rank, or a launcher without torchrun's store): as if all see the same GPUs
        every, distinct = gpus > 0, min(gpus, local_world)
    own = every and distinct == local_world                    # no two local ranks on one GPU
    shared = every and not own and gpus_can_be_shared()        # several local ranks a GPU (NCCL 2.30+)
    if backend == "auto":  # nccl when each local rank has a GPU, its own or a shared one; else gloo on the CPU
        backend = "nccl" if own or shared else "gloo"
    if backend == "nccl" and gpus == 0:   # nothing to share: no word of NCCL versions or switches
        fail("--backend nccl runs on GPUs and this process sees none (torch.cuda.device_count() is 0); use "
             "--backend gloo, or --backend auto, which takes gloo where there is no GPU")
    if backend == "nccl" and not (own or shared):
        fail(f"--backend nccl needs one GPU per local rank: {local_world} local ranks, {distinct} GPUs (ranks share a "
             f"GPU only with NCCL 2.30 or later and {SHARE_SWITCH}=1: {sharing_state()}); use --backend gloo, "
             f"fewer processes per node, or a torch whose NCCL is 2.30+ with the switch (docs/gpu.md)")
    if backend == "nccl" and world > 1 and "LOCAL_RANK" not in environ:
        fail(f"--backend nccl at world size {world} needs LOCAL_RANK (which GPU is mine), which this "
             f"launcher did not set: every rank would use cuda:0; launch with torchrun, or set LOCAL_RANK")
    if backend == "nccl" and shared and local_rank == 0:
        print(f"note: {local_world} local ranks share {distinct} GPU{'s' if distinct > 1 else ''} (rank r on "
              f"cuda:r % {gpus}; {sharing_state()}): right for checking results, not for timing them, since the "
              f"ranks share the GPU's cores", flush=True)
    device = torch.device(f"cuda:{index}") if backend == "nccl" else torch.device("cpu")
    return Env(rank, world, local_rank, local_world, backend, device)


def gpu_uuid(index):
    """The GPU's UUID: the same physical GPU gives the same one whatever index a process sees it under."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpus(store, rank, local_rank, local_world, mine, timeout_s):
    """The UUID of the GPU each local rank of my node takes ("" where it has none), in local-rank order:
    each writes its own, then reads all of them in one call. torchrun numbers a node's ranks
    consecutively, so rank - local_rank names the node."""
    node = rank - local_rank
    store.set(f"gpu/{node}/{local_rank}", mine)
    return read_all(store, [f"gpu/{node}/{r}" for r in range(local_world)], timeout_s,
                    f"rank {rank} waited for the GPUs of its node's {local_world} local ranks (torchrun's store)")


def read_all(store, keys, timeout_s, what):
    """The values of keys, as str, in one request: Store.multi_get waits until every key is set (one
    get per key would make W ranks send W^2 requests to the one store). A torch without multi_get: wait
    for them all, then get each. A key that never comes ends in a CommError naming `what`."""
    with awaiting(what, timeout_s):
        if not hasattr(store, "multi_get"):
            store.wait(keys)
            return [store.get(k).decode() for k in keys]
        return [v.decode() for v in store.multi_get(keys)]


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
    """--backend auto is decided from each node's GPUs, so nodes with different GPUs would pick
    different backends and hang in the first collective. On one node the choice is the same
    everywhere; across nodes the ranks compare choices on torchrun's store before any process group
    exists (each reads every rank's in one request), and all refuse with the numbers if they differ."""
    if requested != "auto" or env.world_size == env.local_world_size:
        return
    if store is None:
        fail(f"--backend auto on {env.world_size // env.local_world_size} nodes needs torchrun (its store "
             f"lets the nodes agree on one backend); use --backend gloo or --backend nccl")
    store.set(str(env.rank), env.backend)
    choices = read_all(store, [str(r) for r in range(env.world_size)], timeout_s,
                       f"rank {env.rank} waited for the {env.world_size} ranks' backend choices (torchrun's store)")
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
    try:   # no process group yet: a store that never answers is one error line, not a traceback
        store = torchrun_store(args.timeout_s)
        env = torchrun_env(args.backend, store, args.timeout_s)
        agreeing = None if store is None else dist.PrefixStore("backend-auto", store)
        agree_on_backend(env, args.backend, args.timeout_s, agreeing)
    except CommError as e:
        print_error(e)
        exit_now(1)
    env.timeout_s = args.timeout_s
    if env.device.type == "cuda":
        # no TORCH_NCCL_BLOCKING_WAIT: it would turn every wait into a CPU spin, so the host could
        # never queue work ahead of the GPU. A hang ends at the step's one bounded wait (clock).
        torch.cuda.set_device(env.device)
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                            store=dist.HashStore() if env.world_size == 1 else store,
                            timeout=group_timeout(env, args.timeout_s),
                            device_id=env.device if env.device.type == "cuda" else None)
    try:
        # every rank is up; and on nccl, batch_isend_irecv must not be the first collective
        with awaiting(f"rank {env.rank} waited for all {env.world_size} ranks to start", args.timeout_s):
            dist.barrier()
        yield env
    except BaseException as e:  # noqa: BLE001 (every way out must skip the teardown below)
        leave_without_teardown(e, env)
    dist.destroy_process_group()


def torchrun_store(timeout_s):
    """Under torchrun: its store (its agent hosts it at MASTER_ADDR:MASTER_PORT), with this attempt's
    keys under a prefix of their own; the ranks compare their GPUs and backends on it, and the process
    group is made on it. torch 2.15's torchrun no longer prefixes a restarted attempt's keys
    (--max-restarts), so without the prefix the new ranks would read the dead attempt's gloo addresses
    and hang or be refused in init_process_group. One process, or another launcher: None (the process
    group then takes init_process_group's default, env://)."""
    by_torchrun = "TORCHELASTIC_RESTART_COUNT" in os.environ and "MASTER_ADDR" in os.environ
    if int(os.environ.get("WORLD_SIZE", 1)) == 1 or not by_torchrun:
        return None
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    with awaiting(f"rank {os.environ.get('RANK', 0)} waited for torchrun's store at {address}", timeout_s):
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


ABORT_WAIT_S = 5   # how long a failed rank gives nccl to abort its communicators before it exits anyway


def leave_without_teardown(e, env=None):
    """End this rank after an exception without destroy_process_group: on nccl it drains pending
    work, so a rank that failed outside communication (or stopped with an `error:` line) would
    stall until its peers time out. A communication failure prints one `error:` line (exit 1); an
    exit keeps its status; anything else is our bug and keeps its traceback (exit 1). On nccl the
    communicators are aborted first (abort_communicators)."""
    if isinstance(e, SystemExit):
        status = e.code if isinstance(e.code, int) else 1
    else:
        status = 1
        if isinstance(e, RuntimeError) and is_comm_failure(e):
            print_error(e)
        else:
            traceback.print_exception(e)
    abort_communicators(env)
    exit_now(status)


def abort_communicators(env):
    """On nccl, abort every communicator (ncclCommAbort) before this rank exits: its queued kernels stop
    and its connections close, so the peers' collectives fail over the network at once instead of
    waiting for data that will never come, and each peer then leaves through its own bounded wait
    (--timeout-s) at the latest, not nccl's watchdog's (twice that, and a margin: group_timeout).
    Bounded: the abort runs on a thread of its own, given ABORT_WAIT_S, since a wedged GPU can stall it.
    gloo needs none: its peers see this process's sockets close when it exits."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)   # torch 2.4 and later
    if env is None or env.backend != "nccl" or abort is None or not dist.is_initialized():
        return
    worker = threading.Thread(target=abort, daemon=True)
    worker.start()
    worker.join(ABORT_WAIT_S)


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


POLL_MIN_S, POLL_MAX_S = 20e-6, 2e-3   # bounded_wait's first and longest pause between two polls


def bounded_wait(finished, timeout_s, awaited):
    """Poll finished() until it is true; after timeout_s (None: for ever) raise a CommError. The pause
    between polls grows with the time waited (a 50th of it, from 20 us up to 2 ms): a wait of a few ms
    (a step) is seen within about 2% of its length, as the clock needs, while a long one (a peer lost,
    waited for minutes) polls some 500 times a second, not the 50,000 that 20 us would."""
    start = time.monotonic()
    while not finished():
        waited = time.monotonic() - start
        if timeout_s is not None and waited > timeout_s:
            raise CommError(f"waited {timeout_s:g} s for {awaited()} to finish on the device and gave up "
                            f"(a peer is gone or a message was never matched)")
        time.sleep(min(POLL_MAX_S, max(POLL_MIN_S, waited / 50)))


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
