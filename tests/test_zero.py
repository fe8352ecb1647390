"""ZeRO-1, 2 and 3 (--zero 1, 2, 3, mp/zero.py, mp/buckets.py, mp/param_shards.py): the same training as
without them, half the optimizer state at D=2 (--zero 2: half the gradients too; --zero 3: and half the
weights, a quarter at D=4), the bytes each replica sends per step as the formula says, and checkpoints
in the baseline's coordinates that resume with or without it and in the baseline; the identity it
stands on (reduce-scatter + all-gather = all-reduce) on gloo; its refusals."""
import json
import shutil

import pytest
import torch
import torch.distributed as dist

import parallel_3d
import pipeline_dp_joint
import single_baseline
import tensor_parallel
from helpers import FAST, assert_one_error_line, assert_same_losses, launch, run_ranks, slow
from mp.dp_collectives import ALL_GATHER, REDUCE_SCATTER
from test_optimizer import ADAMW, STEPS, assert_same_state, full_tensors, reference, saved_run  # noqa: F401

JOINT = ("pipeline_dp_joint.py", ["--dp", "2", "--microbatches", "2"], 4)


def _identity_case(rank, world, group):
    """Each rank's flat gradient: reduce-scatter then all-gather gives every rank exactly what one
    all-reduce gives, and each collective moves (D-1)/D of the buffer per rank on a ring: together the
    all-reduce's 2(D-1)/D."""
    g = torch.Generator().manual_seed(rank)
    grad = torch.randn(world * 1000 + 0, generator=g)
    summed = grad.clone()
    dist.all_reduce(summed)
    mine = torch.empty(grad.numel() // world)
    REDUCE_SCATTER(mine, grad, group=None)
    assert torch.equal(mine, summed[rank * mine.numel():(rank + 1) * mine.numel()])   # my slice of the sum
    whole = torch.empty_like(grad)
    ALL_GATHER(whole, mine, group=None)
    assert torch.equal(whole, summed)
    in_place = grad.clone()                  # mp.buckets: into my slice of the buffer itself, no buffer of its own
    REDUCE_SCATTER(in_place[rank * mine.numel():(rank + 1) * mine.numel()], in_place, group=None)
    assert torch.equal(in_place[rank * mine.numel():(rank + 1) * mine.numel()], mine)


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_then_all_gather_is_an_all_reduce(world, tmp_path):
    """At D = 2 a sum of two terms has one order; at D = 4 gloo's reduce-scatter and all-reduce add the
    four in the same order too: bit for bit (issue 57)."""
    run_ranks(_identity_case, world, tmp_path)


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("joint-adamw")
    run = saved_run(JOINT[0], JOINT[1], JOINT[2], directory, save_every=STEPS // 2)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, directory


def test_zero_trains_as_without_it_with_half_the_state(unsharded, reference, tmp_path):
    """pipeline_dp_joint.py --zero 1 against the same run without it: the losses and the saved weights
    and state (gathered into the baseline's coordinates) agree to float32 rounding, the baseline's
    within the contract; each replica's optimizer state is half of what it held."""
    run = saved_run(JOINT[0], JOINT[1] + ["--zero", "1"], JOINT[2], tmp_path, save_every=STEPS // 2)
    assert_same_losses(run, unsharded[0], atol=1e-6)
    assert_same_losses(run, reference[0])
    got = full_tensors(tmp_path / "ck" / f"step-{STEPS:08d}", tmp_path / "zero.pt")
    want = full_tensors(unsharded[1] / "ck" / f"step-{STEPS:08d}", tmp_path / "plain.pt")
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert_same_state(got, full_tensors(reference[1] / "ck" / f"step-{STEPS:08d}", tmp_path / "baseline.pt"))
    plain, zero = (r.events("summary")[0]["optimizer_state_mb"] for r in (unsharded[0], run))
    for rank in plain:                    # half, give or take the padding of a bucket to a multiple of D
        assert abs(zero[rank] - plain[rank] / 2) <= 1e-3, (zero, plain)
    params = run.events("summary")[0]["param_mb"]
    assert all(abs(plain[r] - 2 * params[r]) <= 1e-3 for r in plain)   # AdamW: twice the parameters


def test_zero2_trains_as_without_it_with_half_the_gradients_and_state(unsharded, reference, tmp_path):
    """Issue 44, item 1: pipeline_dp_joint.py --zero 2 (2 replicas x 2 stages, AdamW, dropout and clipping)
    logs the run without it to float32 rounding and the baseline within the contract; between steps each
    replica holds half the gradients (the whole buckets let go after the reduce-scatter) and half the
    state; its checkpoint holds the same weights and state, in the baseline's coordinates."""
    run = saved_run(JOINT[0], JOINT[1] + ["--zero", "2"], JOINT[2], tmp_path)
    assert_same_losses(run, unsharded[0], atol=1e-6)
    assert_same_losses(run, reference[0])
    got = full_tensors(tmp_path / "ck" / f"step-{STEPS:08d}", tmp_path / "zero2.pt")
    want = full_tensors(unsharded[1] / "ck" / f"step-{STEPS:08d}", tmp_path / "plain.pt")
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    plain, zero = (r.events("summary")[0] for r in (unsharded[0], run))
    for rank in plain["grad_mb"]:         # half, give or take the padding of a bucket to a multiple of D
        assert abs(plain["grad_mb"][rank] - plain["param_mb"][rank]) <= 1e-3, plain   # unsharded: as the params
        assert abs(zero["grad_mb"][rank] - plain["grad_mb"][rank] / 2) <= 1e-3, (zero["grad_mb"], plain["grad_mb"])
        assert abs(zero["optimizer_state_mb"][rank] - plain["optimizer_state_mb"][rank] / 2) <= 1e-3


def test_zero2_as_plain_data_parallelism_with_sgd_matches_the_baseline(baseline, tmp_path):
    """--dp equal to the world size is plain data parallelism (one stage): --zero 2 with SGD's momentum,
    dropout and clipping logs the baseline's losses."""
    flags = FAST + ["--model", "mlp", "--layers", "3", "--hidden", "32", "--batch-size", "16", "--steps", "8",
                    "--dropout", "0.1", "--clip-grad-norm", "0.5"]
    run = launch("pipeline_dp_joint.py", flags + ["--dp", "2", "--microbatches", "2", "--zero", "2"], tmp_path, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_losses(run, baseline(flags))
    assert "replicas of every stage: not compared, the same bytes by construction" in run.stdout


@pytest.mark.parametrize("zero", [slow(["--zero", "1"]), ["--zero", "3", "--zero3-gather", "microbatch"]], ids=["zero1", "zero3"])
def test_a_zero_checkpoint_resumes_without_zero_and_in_the_baseline(reference, unsharded, zero, tmp_path):
    """A --zero 1 (--zero 3) run saves after step 10 (each replica its slices of the state, under --zero 3 of the
    weights too: a sharded state); the run without --zero and single_baseline.py resume from it, and a run
    with the same --zero resumes from the checkpoint the run without --zero saved after step 10 (each
    replica cuts its slice out): each logs the uninterrupted baseline's losses for steps 10..19."""
    want = {r["step"]: r["loss"] for r in reference[0].events("train")}
    (tmp_path / "first").mkdir()
    first = saved_run(JOINT[0], JOINT[1] + zero, JOINT[2], tmp_path / "first", save_every=STEPS // 2)
    assert first.returncode == 0, first.stderr[-3000:]
    resumes = {"plain": (JOINT, tmp_path / "first"), "baseline": (("single_baseline.py", [], 1), tmp_path / "first"),
               "zero": ((JOINT[0], JOINT[1] + zero, JOINT[2]), unsharded[1])}
    for name, ((program, extra, nproc), source) in resumes.items():
        folder = tmp_path / name
        shutil.copytree(source / "ck", folder / "ck")
        shutil.rmtree(folder / "ck" / f"step-{STEPS:08d}")    # resume from step 10
        resumed = saved_run(program, extra, nproc, folder)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert resumed.events("resume")[0]["step"] == STEPS // 2, name
        assert resumed.events("resume")[0]["from"]["program"] == "pipeline_dp_joint", name
        got = {r["step"]: r["loss"] for r in resumed.events("train")}
        assert sorted(got) == list(range(STEPS // 2, STEPS)), name
        assert max(abs(got[k] - want[k]) for k in got) <= 1e-4, name


@pytest.mark.slow
def test_a_3d_zero_checkpoint_of_slices_resumes_in_other_layouts(reference, tmp_path):
    """Issue 58, item 4: parallel_3d.py --dp 2 --tp 2 --zero 2 saves after step 10, each replica its flat
    slices of its tp shards (keys `@dim:start:length#first:count:shape`, nothing gathered);
    single_baseline.py and pipeline_dp_joint.py --dp 2 --zero 3 (2 stages) resume from it on the
    uninterrupted baseline's losses for steps 10..19."""
    want = {r["step"]: r["loss"] for r in reference[0].events("train")}
    (tmp_path / "first").mkdir()
    first = saved_run("parallel_3d.py", ["--dp", "2", "--tp", "2", "--microbatches", "2", "--zero", "2"], 4,
                      tmp_path / "first", save_every=STEPS // 2)
    assert first.returncode == 0, first.stderr[-3000:]
    from mp.checkpoint import dcp, parse_key
    keys = dcp().FileSystemReader(str(tmp_path / "first" / "ck" / f"step-{STEPS // 2:08d}")).read_metadata()
    assert any(parse_key(k)[2] and parse_key(k)[3] for k in keys.state_dict_metadata), "no flat slice of a tp shard"
    for name, (program, extra, nproc) in {"baseline": ("single_baseline.py", [], 1),
                                          "joint": (JOINT[0], JOINT[1] + ["--zero", "3"], JOINT[2])}.items():
        shutil.copytree(tmp_path / "first" / "ck", tmp_path / name / "ck")
        shutil.rmtree(tmp_path / name / "ck" / f"step-{STEPS:08d}")    # resume from step 10
        resumed = saved_run(program, extra, nproc, tmp_path / name)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        got = {r["step"]: r["loss"] for r in resumed.events("train")}
        assert sorted(got) == list(range(STEPS // 2, STEPS)), name
        assert max(abs(got[k] - want[k]) for k in got) <= 1e-4, name


@pytest.mark.slow   # the quick subset keeps test_zero3_in_3d_trains_as_without_it's first layout
@pytest.mark.parametrize("layout", [["--dp", "2", "--tp", "2"], ["--dp", "2", "--tp", "2", "--schedule", "zb"]])
def test_zero_in_3d_trains_as_without_it(layout, tmp_path):
    flags = layout + ["--microbatches", "2"]
    runs = [launch("parallel_3d.py", ADAMW + flags + ["--zero", z], tmp_path, nproc=4, log_name=f"z{z}.jsonl")
            for z in "012"]
    for run in runs[1:]:                  # --zero 1 and --zero 2
        assert_same_losses(run, runs[0], atol=1e-6)
        assert "replicas of every stage: not compared, the same bytes by construction" in run.stdout
    grads = [run.events("summary")[0]["grad_mb"] for run in runs]
    assert all(abs(grads[2][r] - grads[0][r] / 2) <= 1e-3 for r in grads[0]), grads


@pytest.mark.parametrize("parse,argv,world,message", [
    (pipeline_dp_joint.parse_args, ["--zero", "1", "--dp", "1"], 3, "error: --zero 1 splits the optimizer state"),
    (pipeline_dp_joint.parse_args, ["--zero", "1", "--schedule", "2bw", "--microbatches", "4", "--batch-size", "64"],
     4, "error: --zero 1 does not run with --schedule 2bw"),
    (parallel_3d.parse_args, ["--zero", "1", "--dp", "1"], 4, "error: --zero 1 splits the optimizer state"),
    (tensor_parallel.parse_args, ["--zero", "1"], 2, "error: --zero 1: tensor_parallel.py has no data-parallel axis"),
    (pipeline_dp_joint.parse_args, ["--zero", "2", "--dp", "1"], 3,
     "error: --zero 2 splits the optimizer state and the gradients over the data-parallel replicas"),
    (single_baseline.parse_args, ["--zero", "2"], 1, "error: --zero 2: single_baseline.py has no data-parallel axis"),
    (pipeline_dp_joint.parse_args, ["--zero", "4"], 4, "error: argument --zero: invalid choice"),
    (pipeline_dp_joint.parse_args, ["--zero", "3", "--dp", "1"], 3,
     "error: --zero 3 splits the optimizer state, the gradients and the weights over the data-parallel replicas"),
    (pipeline_dp_joint.parse_args, ["--zero", "3", "--schedule", "2bw", "--microbatches", "4", "--batch-size", "64"],
     4, "error: --zero 3 does not run with --schedule 2bw"),
    (pipeline_dp_joint.parse_args, ["--zero", "2", "--zero3-gather", "microbatch"], 4,
     "error: --zero3-gather microbatch says when --zero 3 gathers the weights, and this run has --zero 2"),
    (parallel_3d.parse_args, ["--zero3-gather", "step"], 4, "error: --zero3-gather step says when --zero 3"),
    (tensor_parallel.parse_args, ["--zero", "3"], 2, "error: --zero 3: tensor_parallel.py has no data-parallel axis"),
])
def test_zero_where_it_cannot_run_is_one_error_line(parse, argv, world, message, monkeypatch, capsys):
    assert_one_error_line(parse, argv, world, message, monkeypatch, capsys)


@pytest.mark.parametrize("microbatches,gather", [("1", "microbatch"), ("4", "step")])
def test_zero3_gathers_for_every_use_by_default_with_one_microbatch(microbatches, gather, monkeypatch):
    """Issue 66: with one microbatch there is nothing to keep the weights for between uses, so --zero 3's
    default frees each block after its forward and gathers it again for its backward, as FSDP2 does
    (reshard_after_forward); with several, it gathers once a step."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = pipeline_dp_joint.parse_args(["--dp", "4", "--zero", "3", "--microbatches", microbatches,
                                         "--batch-size", "64"])
    assert args.zero3_gather == gather


def state_bytes(optimizer):
    """The bytes of optimizer state a ZeroOptimizer holds: its slices' state."""
    return sum(t.numel() * t.element_size() for s in optimizer.inner.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim())


def _save_keeps_the_slice_case(rank, world, group):
    """Issue 43, item 6, and issue 58, item 4: a --zero 1 save writes each replica's slices (a sharded
    state: no all-gather, no whole copy): afterwards the replica holds its slice's state only, as before
    the save, and the checkpoint holds the whole state, put together from the replicas' pieces."""
    import argparse
    import os

    import torch.nn as nn

    from mp import checkpoint, zero
    from mp.buckets import GradBuckets
    from mp.zero import ZeroOptimizer
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    args = argparse.Namespace(optimizer="adamw", lr=1e-3, momentum=0.9, weight_decay=0.0, beta1=0.9, beta2=0.999,
                              adam_eps=1e-8, checkpoint_dir=os.environ["SAVE_DIR"], model="mlp", timeout_s=30)
    grads = GradBuckets(list(model.parameters()), None, ("the test's all-reduce", 30), shard=True)
    optimizer = ZeroOptimizer(grads, args)
    grads.zero_grad()
    model(torch.randn(8, 64)).square().mean().backward()
    grads.final(list(model.parameters()))
    grads.wait()
    optimizer.step()
    before = state_bytes(optimizer)
    whole = 2 * 4 * sum(p.numel() for p in model.parameters())   # AdamW's two moments, float32
    assert before <= whole / world + 2 * 4 * world * len(grads.buckets)   # my slice (padding aside)
    gathers = []
    with pytest.MonkeyPatch.context() as patch:     # a save gathers nothing
        patch.setattr(zero, "all_gather", lambda *a, **k: gathers.append(a))
        checkpoint.save(args, 1, model, optimizer, {"program": "test"}, rank)
    assert not gathers and state_bytes(optimizer) == before, (state_bytes(optimizer), before)
    if rank == 0:                                   # every element of every tensor, from the two replicas' pieces
        step = os.path.join(args.checkpoint_dir, "step-00000001")
        got = full_tensors(step, os.path.join(args.checkpoint_dir, "x.pt"))
        for name, p in model.named_parameters():
            assert torch.equal(got[f"param/{name}"], p.detach()), name
            assert got[f"exp_avg/{name}"].shape == p.shape and got[f"exp_avg/{name}"].abs().sum() > 0, name


def test_a_zero_save_leaves_each_replica_its_slice_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SAVE_DIR", str(tmp_path / "ck"))
    run_ranks(_save_keeps_the_slice_case, 2, tmp_path)


# ----------------------------------------------------------------------------- ZeRO-3


def ring_mb(mb, replicas, halves):
    """What a ring sends of a collective of mb over `replicas` ranks: (D-1)/D of it per half."""
    return halves * (replicas - 1) / replicas * mb


@pytest.mark.parametrize("gather", ["step", slow("microbatch")])
def test_zero3_trains_as_without_it_with_half_the_weights(unsharded, reference, gather, tmp_path):
    """Issue 44, items 2-4: pipeline_dp_joint.py --zero 3 (2 replicas x 2 stages, AdamW, dropout and
    clipping; the weights gathered once a step, or for every microbatch's forward and backward) logs the
    run without it to float32 rounding and the baseline within the contract, saves the same checkpoint
    (each replica its slices of the weights and state); between steps each replica holds half of its stage's weights,
    gradients and state; it sends per step the bytes the formula says: (D-1)/D of the gradients a
    microbatch (a reduce-scatter in each one's backward) plus (D-1)/D of the weights once a step (step)
    or twice a microbatch (microbatch), where plain data parallelism's all-reduce sends 2(D-1)/D of the
    gradients."""
    flags = JOINT[1] + ["--zero", "3", "--zero3-gather", gather]
    run = saved_run(JOINT[0], flags, JOINT[2], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_losses(run, unsharded[0], atol=1e-6)
    assert_same_losses(run, reference[0])
    assert "replicas of every stage: not compared, the same bytes by construction" in run.stdout
    got = full_tensors(tmp_path / "ck" / f"step-{STEPS:08d}", tmp_path / "zero3.pt")
    want = full_tensors(unsharded[1] / "ck" / f"step-{STEPS:08d}", tmp_path / "plain.pt")
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    plain, zero = (r.events("summary")[0] for r in (unsharded[0], run))
    m = 2                                   # JOINT's microbatches
    for rank in plain["param_mb"]:          # half, give or take the padding of a block to a multiple of D
        for field in ("param_mb", "grad_mb", "optimizer_state_mb"):
            assert abs(zero[field][rank] - plain[field][rank] / 2) <= 1e-3, (field, zero[field], plain[field])
        weights = plain["param_mb"][rank]
        assert abs(plain["dp_sent_mb_per_step"][rank] - ring_mb(weights, 2, 2)) <= 1e-3, plain
        gathers = 1 if gather == "step" else 2 * m
        # issue 58: a reduce-scatter of the gradients in every microbatch's backward
        assert abs(zero["dp_sent_mb_per_step"][rank] - ring_mb(weights, 2, m + gathers)) <= 1e-3, zero
        # at the peak: my slices and, gathered, at most the whole stage (step) or a block and the next
        assert zero["param_mb"][rank] < zero["peak_param_mb"][rank] <= zero["param_mb"][rank] + weights + 1e-3


@pytest.mark.slow
def test_zero3_as_plain_data_parallelism_on_4_replicas_holds_a_quarter(baseline, tmp_path):
    """--dp equal to the world size is plain data parallelism (one stage): --zero 3 on 4 replicas with
    SGD's momentum, dropout and clipping, the weights gathered for every microbatch, logs the baseline's
    losses; each replica holds a quarter of the weights, gradients and momentum, and at its peak only
    the blocks running (the largest two of the mlp's here) beside its slices."""
    flags = FAST + ["--model", "mlp", "--layers", "4", "--hidden", "64", "--batch-size", "16", "--steps", "6",
                    "--dropout", "0.1", "--clip-grad-norm", "0.5", "--eval-every", "3"]
    run = launch("pipeline_dp_joint.py", flags + ["--dp", "4", "--microbatches", "2", "--zero", "3",
                                                  "--zero3-gather", "microbatch"], tmp_path, nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    want = baseline(flags)
    assert_same_losses(run, want)
    assert [e["test_loss"] for e in run.events("eval")] == pytest.approx([e["test_loss"] for e in want.events("eval")],
                                                                         abs=1e-4)
    summary, model = run.events("summary")[0], run.events("summary")[0]["model_param_mb"]
    for rank in range(4):
        for field in ("param_mb", "grad_mb", "optimizer_state_mb"):
            assert abs(summary[field][str(rank)] - model / 4) <= 1e-3, (field, summary[field], model)
        # 3072x64 + 64 and 64x64 + 64: the first two blocks, whole at once while the first computes
        two = (3072 * 64 + 64 + 64 * 64 + 64) * 4 / 2**20
        assert summary["peak_param_mb"][str(rank)] <= model / 4 + two + 1e-3, summary["peak_param_mb"]


@pytest.mark.parametrize("layout,nproc", [
    (["--dp", "2", "--tp", "2"], 4),
    slow(["--dp", "2", "--tp", "2", "--model", "vit", "--layers", "2", "--hidden", "32", "--heads", "2",
          "--sequence-parallel", "--schedule", "zb"], 4),
    slow(["--dp", "2", "--tp", "2"], 8)])
def test_zero3_in_3d_trains_as_without_it(layout, nproc, tmp_path):
    """parallel_3d.py --zero 3 (dp x tp; dp x tp with sequence parallelism and zb's split backward; dp x
    pp x tp on 8 ranks) logs the run without it to float32 rounding, with half the weights held between
    steps."""
    flags = ADAMW + layout + ["--microbatches", "2", "--eval-every", "10"]
    runs = [launch("parallel_3d.py", flags + z, tmp_path, nproc=nproc, log_name=f"z{i}.jsonl")
            for i, z in enumerate([["--zero", "0"], ["--zero", "3"], ["--zero", "3", "--zero3-gather", "microbatch"]])]
    for run in runs[1:]:
        assert_same_losses(run, runs[0], atol=1e-6)
        assert [e["test_loss"] for e in run.events("eval")] == pytest.approx(
            [e["test_loss"] for e in runs[0].events("eval")], abs=1e-6)   # evaluated on the weights gathered whole
        assert "replicas of every stage: not compared, the same bytes by construction" in run.stdout
        params = [r.events("summary")[0]["param_mb"] for r in (runs[0], run)]
        assert all(abs(params[1][r] - params[0][r] / 2) <= 1e-3 for r in params[0]), params


def test_the_timeline_draws_the_sharded_collectives(tmp_path):
    """--timeline under --zero 1 (whose gloo reduce-scatter has no completion callback: it stopped the run
    before) and --zero 3: the collective row holds each bucket's reduce-scatter and, under --zero 3, each
    block's all-gathers, the first ones while the first microbatch's forward runs (the prefetch)."""
    flags = FAST + ["--model", "mlp", "--layers", "4", "--hidden", "64", "--batch-size", "16", "--steps", "2",
                    "--dp", "2", "--microbatches", "2"]
    for zero in (["--zero", "1"], ["--zero", "3", "--zero3-gather", "microbatch"]):
        trace = tmp_path / f"trace{zero[1]}.json"
        run = launch("pipeline_dp_joint.py", flags + zero + ["--timeline", str(trace)], tmp_path, nproc=2)
        assert run.returncode == 0, run.stderr[-3000:]
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["pid"] == 0]
        names = [e["name"] for e in events if e["cat"] == "collective"]
        assert sum(n.startswith("reduce-scatter") for n in names) >= 1, names
        if zero[1] == "3":                # 4 blocks: gathered for F0, F1, B0, B1
            assert sum(n.startswith("all-gather") for n in names) == 4 * 4, names
            f0 = next(e for e in events if e["name"] == "F0")
            during = [e for e in events if e["name"].startswith("all-gather") and f0["ts"] <= e["ts"] <= f0["ts"] + f0["dur"]]
            assert len(during) >= 2, (f0, names)


# ----------------------------------------------------------------------------- the peak, counted and measured

PEAK = FAST + ["--model", "mlp", "--layers", "4", "--batch-size", "16", "--steps", "3", "--dp", "2",
               "--microbatches", "2", "--optimizer", "adamw"]


def measured_runs(runs, tmp_path):
    """{name: summary} of pipeline_dp_joint.py runs {name: flags} on 2 ranks, all at once (a process's peak
    resident set is its own, whatever runs beside it), each rank a new python started with glibc's mmap
    threshold pinned (the tests' zygote was not; and ranks forked from torchrun's agent start from its
    pages, which set-up's transients then outgrow: a floor 17 MB above what the 8-wide steps held)."""
    import os
    import subprocess
    import sys
    from helpers import ROOT, read_log
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    procs = {name: (subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                      "--", "pipeline_dp_joint.py", *flags, "--log-file", str(tmp_path / f"{name}.jsonl")],
                                     cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
             for name, flags in runs.items()}
    out = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-3000:])
        out[name] = next(r for r in read_log(tmp_path / f"{name}.jsonl") if r["event"] == "summary")
    return out


@pytest.mark.slow
def test_the_counted_peak_is_the_measured_one(tmp_path):
    """Issue 58, item 5: peak_grad_mb and peak_param_mb count the gradients' and weights' bytes where
    buckets and gathers are made and let go. With glibc's mmap threshold pinned (a freed tensor's pages go
    back at once) a rank's peak resident set above its floor (a run with 8-wide layers) is what
    they count with the optimizer state, plus what they leave out: AdamW's two temporaries the size of
    its largest tensor (torch's single-tensor path on the CPU), or autograd's weight gradient before it
    is added into its bucket, and the activations. Plain data parallelism, --zero 2 and --zero 3 (the
    weights gathered for every microbatch) on 2 replicas of the mlp's 4 layers of 1024 (20 MB of
    weights, the first layer 12 MB): each within that; --zero 2 within half a layer of its count. One
    floor serves the three (issue 66: the 8-wide runs' peaks, set-up's, were 457.1-457.3 MB whatever
    --zero), and the four runs go at once: 4 launches where there were 6 in turn."""
    zeros = {"0": ["0"], "2": ["2"], "3": ["3", "--zero3-gather", "microbatch"]}
    runs = {z: PEAK + ["--hidden", "1024", "--zero", *flags] for z, flags in zeros.items()}
    summaries = measured_runs({**runs, "floor": PEAK + ["--hidden", "8"]}, tmp_path)
    tiny = summaries["floor"]
    counted, measured, gathered = {}, {}, {}
    for zero in zeros:
        big = summaries[zero]
        counted[zero] = big["peak_param_mb"]["0"] + big["peak_grad_mb"]["0"] + big["optimizer_state_mb"]["0"]
        measured[zero] = big["peak_memory_mb"]["0"] - tiny["peak_memory_mb"]["0"]
        gathered[zero] = big["peak_param_mb"]["0"] - big["param_mb"]["0"]   # --zero 3: blocks whole at once
    layer = 3072 * 1024 * 4 / 2**20            # the largest tensor, 12 MB
    # measured 2026-11-27: 18-24 MB above the count, the differences within 6 MB; 1 of 10 runs on the 2
    # shared cores failed bounds 4 MB tighter than these
    for zero in counted:
        # --zero 3's two peaks no longer coincide: a block's whole weights go before its bucket is made (issue 66)
        low = counted[zero] - 4 - (gathered[zero] if zero == "3" else 0)
        assert low <= measured[zero] <= counted[zero] + 2 * layer + 8, (zero, counted, measured)
    # issue 66: --zero 3 holds no more than it counts (before: 13 MB more, autograd's gradient beside the
    # bucket and the block's weights, gloo's copies)
    assert measured["3"] <= counted["3"] + 4, (counted, measured)
    # issue 66: under --zero 2 the 12 MB weight's bucket is autograd's own gradient (no copy of it beside the
    # bucket) and gloo's reduce-scatter no longer clones the bucket, so little is left uncounted there
    # (measured 2026-11-28: 6 MB above the count, against 18-24 before); it saves at least what is counted
    assert measured["2"] <= counted["2"] + layer / 2 + 4, (counted, measured)
    assert measured["0"] - measured["2"] >= counted["0"] - counted["2"] - 4, (counted, measured)
    assert counted["0"] - counted["2"] > 10, counted


# ----------------------------------------------------------------------------- outside the steps (issue 82, item 8)


def _resume_reads_my_slices_case(rank, world, group):
    """A resume under --zero reads, of each saved piece, only the part that overlaps this replica's slices,
    straight into them: the elements it asks DCP for are exactly those it holds (no whole tensor, no stage
    put together), whether the checkpoint holds flat slices (saved under --zero) or whole tensors (saved
    without); the weights and state read are the saved ones, every replica's weights whole again after."""
    import argparse
    import os

    import torch.nn as nn

    from mp import checkpoint, optim
    from mp.buckets import GradBuckets
    from mp.zero import ZeroOptimizer
    args = argparse.Namespace(optimizer="adamw", lr=1e-3, momentum=0.9, weight_decay=0.0, beta1=0.9, beta2=0.999,
                              adam_eps=1e-8, model="mlp", timeout_s=30)

    def built(zero, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(24, 20), nn.GELU(), nn.Linear(20, 7))
        if not zero:
            return model, None, optim.make_optimizer(model.parameters(), args)
        grads = GradBuckets(list(model.parameters()), None, ("the test's collectives", 30), shard=True)
        return model, grads, ZeroOptimizer(grads, args)

    def trained(zero):
        model, grads, optimizer = built(zero, 0)
        (grads or optimizer).zero_grad()
        model(torch.randn(8, 24, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        if grads:
            grads.final(list(model.parameters()))
            grads.wait()
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        return model, optimizer

    asked = []
    for saved_zero in (True, False):
        model, optimizer = trained(saved_zero)
        args.checkpoint_dir = os.path.join(os.environ["SAVE_DIR"], str(saved_zero))
        checkpoint.save(args, 1, model, optimizer, {"program": "test"}, rank)
        want = {k: t.clone() for k, t in checkpoint_state(model, optimizer).items()}
        args.resume_from = checkpoint.latest(args.checkpoint_dir)
        fresh, grads, zero = built(True, 5)
        original = checkpoint.SliceReads.item
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(checkpoint.SliceReads, "item", lambda self, key, offsets, lo, sizes, into: (
                asked.append((key, list(sizes))), original(self, key, offsets, lo, sizes, into))[1])
            assert checkpoint.resume(args, fresh, zero, rank)[0] == 1
        mine = sum(t.numel() for *_, t in checkpoint.held(fresh, zero))
        assert sum(int(torch.Size(s).numel()) for _, s in asked) == mine, (asked, mine)
        asked.clear()
        got = checkpoint_state(fresh, zero)
        for k, t in got.items():                      # every weight whole (all-gathered), my slices of the state
            kind, name, _, flat = checkpoint.parse_key(k)   # the same slice saved, or my range of the whole
            saved = want[k] if k in want else want[f"{kind}/{name}"].reshape(-1)[flat[0]:flat[0] + flat[1]]
            assert torch.equal(t, saved), k


def checkpoint_state(model, optimizer):
    """{key: tensor} of what a rank holds, as a save names it (mp.checkpoint.held), the weights whole."""
    from mp import checkpoint
    out = {checkpoint.key(kind, name, spec, flat): t for kind, name, spec, flat, t in
           checkpoint.held(model, optimizer)}
    out.update({f"param/{name}": p.detach() for name, p in model.named_parameters()})
    return out


def test_a_zero_resume_reads_each_replicas_slices_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SAVE_DIR", str(tmp_path / "ck"))
    run_ranks(_resume_reads_my_slices_case, 2, tmp_path)


def test_zero3_resume_and_evaluation_gather_no_more_than_a_step(tmp_path):
    """--zero 3 on 2 replicas of 6 blocks, the weights gathered for every microbatch: the evaluation's forward
    gathers a block at a time as a step's does (it gathered the whole stage first) and a resume reads each
    replica's slices without gathering anything (it gathered the whole stage to put the pieces in): the
    weights held at the peak of each (the summary's resume_peak_param_mb, eval_peak_param_mb) are at most a
    step's (peak_param_mb), the resume's only the slices; the resumed run logs the uninterrupted run's losses
    and test loss to the bit."""
    flags = FAST[:FAST.index("--eval-every")] + FAST[FAST.index("--eval-every") + 2:] + [
        "--model", "mlp", "--layers", "6", "--hidden", "48", "--batch-size", "16", "--optimizer", "adamw",
        "--dp", "2", "--microbatches", "2", "--zero", "3", "--zero3-gather", "microbatch", "--eval-every", "2",
        "--save-every", "2", "--steps", "4"]
    whole = launch("pipeline_dp_joint.py", flags + ["--checkpoint-dir", str(tmp_path / "ck")], tmp_path, nproc=2,
                   log_name="whole.jsonl")
    assert whole.returncode == 0, whole.stderr[-3000:]
    shutil.rmtree(tmp_path / "ck" / "step-00000004")
    resumed = launch("pipeline_dp_joint.py", flags + ["--checkpoint-dir", str(tmp_path / "ck")], tmp_path, nproc=2,
                     log_name="resumed.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.losses() == whole.losses()[2:]
    assert [e["test_loss"] for e in resumed.events("eval")] == [e["test_loss"] for e in whole.events("eval")][1:]
    blocks = [(3072 * 48 + 48) * 4 / 2**20] + [(48 * 48 + 48) * 4 / 2**20] * 4 + [(48 * 10 + 10) * 4 / 2**20]
    for run in (whole, resumed):
        summary = run.events("summary")[0]
        for rank in ("0", "1"):
            held, step = summary["param_mb"][rank], summary["peak_param_mb"][rank]
            evaluation = summary["eval_peak_param_mb"][rank]
            assert held < evaluation <= step, (evaluation, step)
            assert evaluation <= held + blocks[0] + blocks[1] + 1e-3, (evaluation, held)   # two blocks, not six
    summary = resumed.events("summary")[0]
    assert summary["resume_peak_param_mb"] == summary["param_mb"], summary   # nothing gathered: the slices
    assert "resume_peak_param_mb" not in whole.events("summary")[0]
