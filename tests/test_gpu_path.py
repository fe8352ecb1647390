"""The code that exists for nccl and CUDA, driven on gloo and the CPU where a test can reach it (no
GPU here: docs/gpu.md says what was only reasoned). The one-Work-per-batch branch of the pipeline's
exchange, the waits with --timeout-s, the backend agreement, LOCAL_RANK, the teardown after an
exception, the timeline's device clock, and the averaging of tensor-parallel replicated gradients."""
import argparse
import datetime
import os
import subprocess
import sys
import threading
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp import data as mp_data
from mp import dist as mp_dist
from mp import errors
from mp import log as mp_log
import pipeline_microbatch as pm
import tensor_parallel as tp
from mp import replicas as replicas_mod
from mp.dist import Env
from mp.models import build_model
from mp.data import SyntheticData
from helpers import FAST, PYTHON, ROOT, run_ranks
from mp.pp.p2p import SENDS_KEPT, PipelineError
from mp.pp.schedules import SCHEDULES, placement_of, schedule_actions

MLP = FAST + ["--model", "mlp", "--hidden", "16", "--layers", "4", "--batch-size", "8"]


class OneWork:
    """What nccl's batch_isend_irecv returns: one Work for the whole batch of operations."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for work in self.works:
            work.wait(timeout)
        return True


GLOO_BATCH = dist.batch_isend_irecv          # one Work per operation


def as_on_nccl(ops):
    return [OneWork(GLOO_BATCH(ops))] if ops else []


def _one_work_case(rank, world, group):
    """Training steps of every schedule through the nccl branch give the same loss as the gloo branch.
    What it shows: the Messenger's handling of one Work a batch and of sends kept in flight. What it
    cannot: gloo under the shim never blocks a stream, so an order of posts that deadlocks nccl passes
    here; tests/test_nccl_order.py (every program on its nccl paths, sends and receives only in batches)
    and the plans' dry run with blocking sends (tests/test_schedules.py) carry that claim."""
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    x, y = SyntheticData(0).batch(0, 8)
    for schedule in SCHEDULES:
        args = pm.parse_args(MLP + ["--schedule", schedule, "--microbatches", "4"])
        pos = pm.PipelineRank(rank, world, list(range(world)), args.virtual_stages, placement=placement_of(schedule))
        losses = []
        for batched in (GLOO_BATCH, as_on_nccl):
            pm.dist.batch_isend_irecv = batched
            # nccl posts no receive ahead of its exchange (mp.pp.p2p: 0 exchanges ahead on cuda)
            _, runner = pm.setup_stage(args, env, pos, messenger=None if batched is GLOO_BATCH else
                                       partial(pm.Messenger, ahead=0))
            messenger, held = runner.messenger, []
            if batched is as_on_nccl:         # and sends kept in flight, as on cuda (mp.pp.p2p.sends_kept)
                messenger.kept, finish = SENDS_KEPT, messenger.finish
                messenger.finish = lambda keep=0: (held.append(len(messenger.sending)), finish(keep))
            losses.append(pm.forward_backward(runner, schedule_actions(schedule, pos, 4), x, y, 4))
            assert messenger.sending == []
            assert batched is GLOO_BATCH or max(held) >= 2, (schedule, held)   # sends held past the next sends
        pm.dist.batch_isend_irecv = GLOO_BATCH
        assert losses[0] == losses[1], (schedule, losses)


def test_the_one_work_per_batch_branch_trains_like_gloos(tmp_path):
    run_ranks(_one_work_case, 2, tmp_path)


def _timeout_case(rank, world, group):
    """A receive whose send never comes ends after --timeout-s with the pipeline's named error,
    through the one-Work branch too (the wait takes the timeout, as nccl's needs to block)."""
    if rank == 0:
        time.sleep(5)                         # alive, sending nothing, while rank 1 waits 1 s
        return
    pos = pm.PipelineRank(1, 2, [0, 1])
    pm.dist.batch_isend_irecv = as_on_nccl
    messenger = pm.Messenger(pos, [(16,), (16,)], torch.device("cpu"), timeout_s=1.0)
    start = time.perf_counter()
    with pytest.raises(PipelineError) as error:
        messenger.exchange([("recv", 0, ("act", 0, 1))], {}, 2)
    assert time.perf_counter() - start < 20
    assert str(error.value).startswith("stage 1 waited to recv the activation of microbatch 0 from rank 0 "
                                       "and gave up (timeout 1 s)"), error.value
    sys.stdout.flush()
    os._exit(0)                               # gloo closed the pair: no teardown to wait for


@pytest.mark.slow
def test_a_wait_gives_up_after_the_timeout_with_its_name(tmp_path):
    run_ranks(_timeout_case, 2, tmp_path)


def test_nccl_without_a_gpu_says_there_is_none(monkeypatch, capsys):
    """Issue 67: no talk of NCCL versions or a sharing switch where there is no GPU at all."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        mp_dist.torchrun_env("nccl")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: --backend nccl runs on GPUs and this process sees none")
    assert "NCCL 2.30" not in err and len(err.splitlines()) == 1, err


def test_nccl_without_local_rank_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")   # bad input is printed by rank 0 alone (every rank exits 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        mp_dist.torchrun_env("nccl")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: --backend nccl at world size 2 needs LOCAL_RANK")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert mp_dist.torchrun_env("nccl").device == torch.device("cuda:1")


def agree(choices):
    """agree_on_backend on one rank per choice (threads sharing one store, 1 rank per node)."""
    store, outcome = dist.HashStore(), {}

    def rank(r):
        env = Env(r, len(choices), 0, 1, choices[r], torch.device("cpu"))
        try:
            mp_dist.agree_on_backend(env, "auto", 10, store)
            outcome[r] = 0
        except SystemExit as e:
            outcome[r] = e.code
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(choices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [outcome.get(r) for r in range(len(choices))]


def test_backend_auto_is_agreed_across_nodes(capsys):
    assert agree(["gloo", "gloo", "gloo"]) == [0, 0, 0]
    capsys.readouterr()
    assert agree(["nccl", "gloo", "nccl"]) == [2, 2, 2]          # every rank refuses, none hangs
    err = capsys.readouterr().err
    assert err.count("error: --backend auto chose nccl on ranks [0, 2] and gloo on the others") == 3, err


SCRIPT = """
import argparse, sys
from mp import dist as mp_dist, errors
mp_dist.dist.destroy_process_group = lambda: print("destroyed", flush=True)
args = argparse.Namespace(threads=1, backend="gloo", timeout_s=10.0)
with mp_dist.distributed(args):
    {body}
mp_dist.exit_now(0)
"""


@pytest.mark.parametrize("body,status,says", [
    ("pass", 0, "destroyed"),
    ("raise ValueError('a bug of ours')", 1, "ValueError: a bug of ours"),
    ("errors.fail('stopped')", 2, "error: stopped"),
    ("raise errors.CommError('rank 0 waited for x')", 1, "error: rank 0 waited for x")])
def test_an_exception_leaves_without_draining_the_process_group(tmp_path, body, status, says):
    """destroy_process_group (on nccl it waits for pending work) runs only after a clean exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([PYTHON, "-c", SCRIPT.format(body=body)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert says in proc.stdout + proc.stderr
    assert ("destroyed" in proc.stdout) == (status == 0)


def test_the_timeline_times_the_device_only_while_recording(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    pos = pm.PipelineRank(0, 1, [0])
    runner = pm.StageRunner([], pos, pm.Messenger(pos, [], torch.device("cuda:0"), 1.0))
    runner.clock()
    assert synced == []                     # unrecorded steps stay asynchronous
    runner.events = []
    runner.record("forward", "F0", 0, runner.clock())
    assert len(synced) == 2 and len(runner.events) == 1
    cpu = pm.StageRunner([], pos, pm.Messenger(pos, [], torch.device("cpu"), 1.0))
    cpu.events = []
    cpu.clock()
    assert len(synced) == 2


def _average_case(rank, world, group):
    """Replicated gradients made to differ per rank (different inputs) come out as their mean, the
    same on every rank; replicas_identical sees a difference and its absence."""
    args = tp.parse_args(FAST + ["--model", "cnn"])
    plain, averaged = (tp.parallelize(build_model(args), "cnn", group) for _ in range(2))
    x, y = SyntheticData(rank).batch(0, 4)          # rank-dependent: the replicated gradients differ
    for model in (plain, averaged):
        F.cross_entropy(model(x), y).backward()
    replicas_mod.average_replicated_grads(averaged, group, torch.device("cuda")).average()   # once, after the backward
    assert replicas_mod.average_replicated_grads(averaged, group, torch.device("cpu")) is None
    for mine, got in zip(replicas_mod.replicated_parameters(plain), replicas_mod.replicated_parameters(averaged)):
        mean = mine.grad.clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(got.grad, mean / world)
        every = [torch.empty_like(got.grad) for _ in range(world)]
        dist.all_gather(every, got.grad)
        assert all(torch.equal(every[0], g) for g in every)
    assert mp_dist.replicas_identical(replicas_mod.replicated_parameters(plain), group)
    with torch.no_grad():
        replicas_mod.replicated_parameters(plain)[0].add_(rank)
    assert not mp_dist.replicas_identical(replicas_mod.replicated_parameters(plain), group)


def test_replicated_gradients_are_averaged_over_the_tp_group(tmp_path):
    run_ranks(_average_case, 2, tmp_path)


def _hybrid_average_case(rank, world, group):
    """--hybrid on a GPU: the convolutions' gradients are all-reduced once (their bucket), not again
    by the averaging; the other replicated tensors (row-parallel biases) are averaged, in one flat
    all-reduce after the backward."""
    args = tp.parse_args(FAST + ["--model", "cnn", "--hybrid"])
    model = tp.parallelize(build_model(args), "cnn", group, hybrid=True)
    replicated = replicas_mod.ReplicatedGrads(model, group)
    calls, real = [], dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: calls.append(t.numel()) or real(t, *a, **k)
    try:
        x, y = SyntheticData(0).batch(0, 4)
        F.cross_entropy(model(x), y).backward()
        tp.sync_tp_grads(model.partial_grads, replicated)   # as tensor_parallel.train_step does
    finally:
        dist.all_reduce = real
    conv = sum(p.numel() for block in list(model)[:2] for p in block.parameters())
    averaged = [p.numel() for p in replicas_mod.replicated_parameters(model) if not getattr(p, "summed_over_ranks", False)]
    # forward: g after fc2 (4 x 84); backward: f before fc3 (4 x 84) and before fc1 (4 x 400), the conv
    # bucket once, and the averaged replicated tensors (fc2's bias)
    assert sorted(calls) == sorted([4 * 84, 4 * 84, 4 * 400, conv] + averaged), calls
    assert averaged == [84]


def test_hybrid_convolution_gradients_are_all_reduced_once(tmp_path):
    run_ranks(_hybrid_average_case, 2, tmp_path)


def test_memory_is_labelled_and_batches_stay_put_on_the_cpu():
    env = mp_dist.torchrun_env("gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fields = mp_log.memory_fields(env, [torch.zeros(2**18)], 2.0)
    finally:
        dist.destroy_process_group()
    assert fields["peak_memory_kind"].startswith("cpu peak RSS") and "peak_reserved_mb" not in fields
    assert fields["param_mb"] == {0: 1.0} and fields["model_param_mb"] == 2.0
    x = torch.ones(2)
    assert mp_data.to_device(x, env.device) is x


def test_the_steps_bounded_wait_names_what_it_awaited():
    """On a GPU the step's one CPU wait polls an event (mp_dist.clock); one that never completes
    ends in a CommError naming the last exchange, after the timeout."""
    start = time.perf_counter()
    with pytest.raises(errors.CommError, match=r"^waited 0.2 s for step 3 \(last exchange: recv_forward mb1\)"):
        mp_dist.bounded_wait(lambda: False, 0.2, lambda: "step 3 (last exchange: recv_forward mb1)")
    assert 0.2 <= time.perf_counter() - start < 5
    mp_dist.bounded_wait(iter([False, True]).__next__, 0.2, lambda: "nothing")   # finishes: no error


def test_nccl_waits_order_streams_and_the_watchdog_waits_longer(monkeypatch):
    """No TORCH_NCCL_BLOCKING_WAIT (every wait would spin the CPU), and the nccl watchdog, which
    aborts without an error line, is armed later than the step's own bounded wait."""
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    gpu, cpu = (Env(0, 2, 0, 2, b, torch.device(d)) for b, d in (("nccl", "cuda:0"), ("gloo", "cpu")))
    assert mp_dist.group_timeout(gpu, 60).total_seconds() > 2 * 60
    assert mp_dist.group_timeout(cpu, 60).total_seconds() == 60
    waited = []

    class Work:
        def wait(self, *timeout):
            waited.append(timeout)
    pos = pm.PipelineRank(0, 2, [0, 1])
    nccl = pm.Messenger(pos, [], torch.device("cuda:0"), 1.0)
    nccl.wait(Work(), [])
    assert waited == [()]                     # no timeout: nccl only orders the stream
    # no receive posted ahead on nccl, where it would hold back the sends its peer waits for (mp.pp.p2p)
    assert nccl.early.k == 0 and pm.Messenger(pos, [], torch.device("cpu"), 1.0).early.k == pm.EXCHANGES_AHEAD > 0
    pm.Messenger(pos, [], torch.device("cpu"), 1.0).wait(Work(), [])
    assert waited[1][0].total_seconds() == 1.0
    # nccl: at its next sends a stage orders its stream after all but its newest SENDS_KEPT sends; gloo: all
    assert nccl.kept == SENDS_KEPT > 0 and pm.Messenger(pos, [], torch.device("cpu"), 1.0).kept == 0
    nccl.sending = [(Work(), None, ("send", 1, ("act", mb, 1))) for mb in range(SENDS_KEPT + 3)]
    nccl.finish(nccl.kept)
    assert len(waited) == 2 + 3 and [part[2][1] for _, _, part in nccl.sending] == list(range(3, SENDS_KEPT + 3))
    nccl.finish()
    assert len(waited) == 2 + 3 + SENDS_KEPT and nccl.sending == []


NCCL_2_30, NCCL_2_28 = (2, 30, 7), (2, 28, 9)


@pytest.mark.parametrize("backend,version,switch,local_world,gpus,local_rank,want", [
    ("nccl", NCCL_2_30, "1", 2, 1, 1, "cuda:0"),     # two ranks on the one GPU
    ("auto", NCCL_2_30, "1", 2, 1, 0, "cuda:0"),     # the user asked for sharing: auto takes nccl
    ("nccl", NCCL_2_30, "1", 3, 2, 2, "cuda:0"),     # round-robin: rank 2 of 3 on 2 GPUs
    ("nccl", NCCL_2_30, "1", 3, 2, 1, "cuda:1"),
    ("nccl", NCCL_2_30, None, 2, 2, 1, "cuda:1"),    # a GPU each: no sharing, no switch needed
    ("auto", NCCL_2_30, None, 2, 1, 0, "cpu"),       # no switch: gloo, as before
    ("auto", NCCL_2_28, "1", 2, 1, 0, "cpu"),        # too old a library: gloo
    ("nccl", NCCL_2_28, "1", 2, 1, 0, "error: --backend nccl needs one GPU per local rank: 2 local ranks, 1 GPUs "
                                      "(ranks share a GPU only with NCCL 2.30 or later and "
                                      "NCCL_MULTI_RANK_GPU_ENABLE=1: NCCL 2.28.9 loaded, NCCL_MULTI_RANK_GPU_ENABLE=1)"),
    ("nccl", NCCL_2_30, None, 2, 1, 0, "NCCL 2.30.7 loaded, NCCL_MULTI_RANK_GPU_ENABLE unset)"),
    ("nccl", NCCL_2_30, "0", 2, 1, 0, "NCCL 2.30.7 loaded, NCCL_MULTI_RANK_GPU_ENABLE=0)"),
    ("nccl", None, "1", 2, 1, 0, "no NCCL library loaded, NCCL_MULTI_RANK_GPU_ENABLE=1)")])
def test_local_ranks_share_a_gpu_only_where_the_loaded_nccl_allows_it(monkeypatch, capsys, backend, version, switch,
                                                                      local_world, gpus, local_rank, want):
    """A fake GPU count and a fake loaded NCCL version: sharing needs both the switch and NCCL 2.30+;
    otherwise nccl is refused with the switch and the version found, and auto takes gloo."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(mp_dist, "loaded_nccl_version", lambda: version)
    # the version torch was built with says the opposite: it must not decide
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: NCCL_2_28 if version == NCCL_2_30 else NCCL_2_30)
    for name, value in (("RANK", local_rank), ("WORLD_SIZE", local_world), ("LOCAL_RANK", local_rank),
                        ("LOCAL_WORLD_SIZE", local_world), (mp_dist.SHARE_SWITCH, switch)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    if want.startswith("cuda") or want == "cpu":
        env = mp_dist.torchrun_env(backend)
        assert env.device == torch.device(want) and env.backend == ("gloo" if want == "cpu" else "nccl")
        out = capsys.readouterr().out
        shared = want != "cpu" and gpus < local_world
        assert out.count("note:") == (shared and local_rank == 0), out     # one line, from local rank 0
        if shared and local_rank == 0:
            assert out.startswith(f"note: {local_world} local ranks share {gpus} GPU"), out
        return
    with pytest.raises(SystemExit) as exit_:
        mp_dist.torchrun_env(backend)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and want in err, err


def test_the_nccl_version_is_read_from_the_library_loaded():
    """Here the CUDA build of torch loads its wheel's libnccl.so.2 (the nvidia-nccl package) on import:
    the version read through ncclGetVersion is that package's. Where no NCCL is loaded, None."""
    from importlib import metadata
    loaded = any("libnccl" in line for line in open("/proc/self/maps"))
    packages = [d.version for d in metadata.distributions() if (d.metadata["Name"] or "").startswith("nvidia-nccl")]
    version = mp_dist.loaded_nccl_version()
    if not loaded:
        assert version is None
        pytest.skip("no NCCL library loaded in this process (a CPU build of torch)")
    assert version is not None and len(version) == 3, version
    if packages:
        assert ".".join(map(str, version)) == packages[0], (version, packages)


class EventNeverDone:
    """A CUDA event whose work never finishes: a peer lost in a collective, as a GPU would see it."""

    def __init__(self, **kwargs):
        pass

    def record(self):
        pass

    def query(self):
        return False


def test_every_rank_reads_the_logged_values_after_a_bounded_wait(monkeypatch):
    """On a GPU the log's sums (nccl collectives) are waited for on every rank, not only on the owner,
    and at most --timeout-s: a lost peer there gives the error naming the step, not nccl's watchdog
    (which aborts without a line, at twice the timeout)."""
    from mp import loop as mp_loop
    monkeypatch.setattr(torch.cuda, "Event", EventNeverDone)
    for owner in (False, True):
        scalars = mp_loop.StepScalars(torch.device("cuda"), 0.2)
        scalars.stop(3, scalars.start(), None, torch.tensor(1.0))
        job = mp_loop.Job(step=None, model=None, optimizer=None, layout={}, owner=owner)
        args = argparse.Namespace(timeout_s=0.2, clip_grad_norm=None)
        with pytest.raises(errors.CommError, match=r"^waited 0.2 s for step 3's queued work and the logged values"):
            scalars.read(job, args, rank=1)


def _summary_gather_case(rank, world, group):
    """The summary's all-gather is read only after settle(), with the run's --timeout-s."""
    settled = []
    real = mp_log.settle
    mp_log.settle = lambda device, timeout_s, awaited: settled.append((device, timeout_s, awaited()))
    try:
        env = Env(rank, world, rank, world, "gloo", torch.device("cpu"), timeout_s=7.0)
        assert mp_log.gather_per_rank(env, float(rank)) == {0: 0.0, 1: 1.0}
    finally:
        mp_log.settle = real
    assert settled == [(torch.device("cpu"), 7.0, f"rank {rank}'s all-gather of the summary's numbers")], settled


def test_the_summarys_gather_is_read_after_a_bounded_wait(tmp_path, monkeypatch):
    run_ranks(_summary_gather_case, 2, tmp_path)
    monkeypatch.setattr(torch.cuda, "Event", EventNeverDone)
    with pytest.raises(errors.CommError, match=r"^waited 0.1 s for the replicas' checksums"):
        mp_dist.settle(torch.device("cuda"), 0.1, lambda: "the replicas' checksums")
    mp_dist.settle(torch.device("cpu"), 0.1, lambda: "nothing")   # the CPU: gloo bounds its collectives


def on_one_node(monkeypatch, seen, backend="auto", switch=None, version=NCCL_2_30, store=None):
    """torchrun_env on one thread per local rank of one node, the ranks sharing a store; local rank r sees
    the fake GPUs seen[r] (their UUIDs, in the order its CUDA_VISIBLE_DEVICES gives them). Returns each
    rank's (backend, device), or its exit status."""
    mine = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: len(mine.gpus) > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(mine.gpus))
    monkeypatch.setattr(mp_dist, "gpu_uuid", lambda index: mine.gpus[index])
    monkeypatch.setattr(mp_dist, "loaded_nccl_version", lambda: version)
    if switch is None:
        monkeypatch.delenv(mp_dist.SHARE_SWITCH, raising=False)
    else:
        monkeypatch.setenv(mp_dist.SHARE_SWITCH, switch)
    store, outcome, n = store or dist.HashStore(), {}, len(seen)

    def rank(r):
        mine.gpus = seen[r]
        environ = {"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n)}
        try:
            env = mp_dist.torchrun_env(backend, store, 10, environ)
            outcome[r] = (env.backend, str(env.device))
        except SystemExit as e:
            outcome[r] = e.code
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [outcome.get(r) for r in range(n)]


@pytest.mark.parametrize("seen,backend,switch,want", [
    # a launcher gives each rank its own GPU through CUDA_VISIBLE_DEVICES: each sees one, cuda:0, not the same
    ([["GPU-a"], ["GPU-b"]], "auto", None, [("nccl", "cuda:0")] * 2),
    ([["GPU-a"], ["GPU-b"], ["GPU-c"], ["GPU-d"]], "nccl", None, [("nccl", "cuda:0")] * 4),
    ([["GPU-a", "GPU-b"]] * 2, "auto", None, [("nccl", "cuda:0"), ("nccl", "cuda:1")]),   # both see both
    # one GPU seen by both: today's rule (NCCL 2.30+ and its switch), else gloo under auto, a refusal under nccl
    ([["GPU-a"], ["GPU-a"]], "auto", None, [("gloo", "cpu")] * 2),
    ([["GPU-a"], ["GPU-a"]], "auto", "1", [("nccl", "cuda:0")] * 2),
    ([["GPU-a"], ["GPU-a"]], "nccl", None, [2, 2]),
    # two GPUs listed in opposite orders: cuda:local_rank is GPU-a for both, which a count cannot see
    ([["GPU-a", "GPU-b"], ["GPU-b", "GPU-a"]], "auto", None, [("gloo", "cpu")] * 2),
    ([["GPU-a"], []], "auto", "1", [("gloo", "cpu")] * 2)])   # a rank with no GPU: gloo on both, not a hang
def test_sharing_is_read_from_the_gpus_the_local_ranks_hold(monkeypatch, capsys, seen, backend, switch, want):
    """Each local rank writes the UUID of the GPU it takes to the store and reads all of them: nccl when
    they are distinct, whatever device_count() each sees against LOCAL_WORLD_SIZE."""
    assert on_one_node(monkeypatch, seen, backend, switch) == want
    captured = capsys.readouterr()
    if 2 in want:
        assert captured.err.count("error: --backend nccl needs one GPU per local rank: 2 local ranks, 1 GPUs") >= 1
    assert captured.out.count("note:") == (switch == "1" and want[0][0] == "nccl"), captured.out


class CountingStore:
    """A store that counts its reads; without_multi_get: as a torch whose Store has no multi_get."""

    def __init__(self, without_multi_get=False, timeout_s=10):
        self.store, self.reads = dist.HashStore(), []
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        if not without_multi_get:
            self.multi_get = lambda keys: self.reads.append(("multi_get", len(keys))) or self.store.multi_get(keys)

    def set(self, key, value):
        self.store.set(key, value)

    def get(self, key):
        self.reads.append(("get", 1))
        return self.store.get(key)

    def wait(self, keys):
        self.store.wait(keys)


@pytest.mark.parametrize("without_multi_get", [False, True])
def test_the_ranks_read_each_others_answers_in_one_request(monkeypatch, capsys, without_multi_get):
    """The backend agreement and the GPUs of a node: each rank reads all the others' in one multi_get,
    not one get per rank (W^2 requests to the one store at W ranks); a torch without multi_get still works."""
    store = CountingStore(without_multi_get)
    assert on_one_node(monkeypatch, [["GPU-a"], ["GPU-b"], ["GPU-c"]], store=store) == [("nccl", "cuda:0")] * 3
    choices = ["gloo", "gloo", "gloo", "gloo"]
    agreement = CountingStore(without_multi_get)
    outcome = {}

    def rank(r):
        mp_dist.agree_on_backend(Env(r, 4, 0, 1, choices[r], torch.device("cpu")), "auto", 10, agreement)
        outcome[r] = 0
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert outcome == {0: 0, 1: 0, 2: 0, 3: 0}
    if without_multi_get:
        assert store.reads == [("get", 1)] * 9 and agreement.reads == [("get", 1)] * 16
    else:
        assert store.reads == [("multi_get", 3)] * 3 and agreement.reads == [("multi_get", 4)] * 4


def test_a_rank_that_never_answers_the_agreement_is_named(monkeypatch):
    """A rank missing from the store's exchange: a CommError naming what was awaited, after the store's
    timeout (distributed() prints it as one error line), not the store's bare DistStoreError."""
    store = CountingStore(timeout_s=0.3)
    with pytest.raises(errors.CommError, match=r"^rank 0 waited for the 2 ranks' backend choices"):
        mp_dist.agree_on_backend(Env(0, 2, 0, 1, "gloo", torch.device("cpu")), "auto", 0.3, store)
    with pytest.raises(errors.CommError, match=r"^rank 0 waited for the GPUs of its node's 2 local ranks"):
        mp_dist.local_gpus(store, 0, 0, 2, "GPU-a", 0.3)


ABORT_SCRIPT = """
import time, torch
from mp import dist as mp_dist, errors
mp_dist.ABORT_WAIT_S = 1
mp_dist.dist.is_initialized = lambda: True
def abort(group=None):
    print("aborted", flush=True)
    {then}
mp_dist.dist.distributed_c10d._abort_process_group = abort
env = mp_dist.Env(0, 2, 0, 2, "{backend}", torch.device("{device}"))
mp_dist.leave_without_teardown({error}, env)
"""


@pytest.mark.parametrize("backend,device,then,error,status,aborted", [
    ("nccl", "cuda:0", "pass", "errors.CommError('rank 0 waited for x')", 1, True),
    ("nccl", "cuda:0", "pass", "SystemExit(2)", 2, True),
    ("nccl", "cuda:0", "time.sleep(600)", "ValueError('a bug of ours')", 1, True)])  # a stuck abort: 1 s, then out
def test_a_failed_rank_aborts_its_nccl_communicators_before_it_exits(backend, device, then, error, status, aborted):
    """On nccl a rank that leaves on an exception aborts its communicators first (its peers' collectives
    then fail instead of waiting for the watchdog), after its error line, for at most ABORT_WAIT_S. (gloo
    aborts nothing: its peers see the sockets close.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.perf_counter()
    proc = subprocess.run([PYTHON, "-c", ABORT_SCRIPT.format(backend=backend, device=device, then=then, error=error)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert ("aborted" in proc.stdout) == aborted, proc.stdout
    assert time.perf_counter() - start < 30


class FakeClock:
    """time for bounded_wait: sleep() moves the clock on at once; every pause is noted."""

    def __init__(self):
        self.now, self.pauses = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.pauses.append(s)
        self.now += s


def test_the_bounded_wait_backs_off(monkeypatch):
    """The pause between polls grows with the time waited, to at most 2 ms: a 2 s wait polls about a
    thousand times (at 20 us, 100,000), and a 3 ms wait still ends within 2% of its length."""
    clock = FakeClock()
    monkeypatch.setattr(mp_dist, "time", clock)
    with pytest.raises(errors.CommError, match=r"^waited 2 s for a lost peer"):
        mp_dist.bounded_wait(lambda: False, 2.0, lambda: "a lost peer")
    assert 2.0 < clock.now < 2.01 and len(clock.pauses) < 1500, (clock.now, len(clock.pauses))
    assert clock.pauses[0] == 20e-6 and max(clock.pauses) == 2e-3 and clock.pauses == sorted(clock.pauses)
    clock.now = 0.0
    mp_dist.bounded_wait(lambda: clock.now >= 0.003, 2.0, lambda: "a step")
    assert clock.now - 0.003 <= 0.003 / 50 + 1e-6, clock.now


def test_a_local_rank_that_never_comes_is_one_error_line(tmp_path):
    """Under torchrun the local ranks compare their GPUs on its store before any process group exists: a
    rank whose sibling never writes its answer leaves after --timeout-s with one error line naming that
    wait (exit 1), not a traceback from inside init_process_group."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(host.port), TORCHELASTIC_RESTART_COUNT="0")
    script = ("import argparse\nfrom mp import dist as mp_dist\n"
              "with mp_dist.distributed(argparse.Namespace(threads=1, backend='auto', timeout_s=1.0)):\n    pass\n")
    proc = subprocess.run([PYTHON, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("[W")]   # c10d's own warnings
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: rank 0 waited for the GPUs of its node's 2 local ranks (torchrun's store), "
                               "and gave up (timeout 1 s)"), lines
