"""parallel_3d.py: dp x pp x tp grids reproduce the baseline step by step, --check compares every shard with
its slice of the full model, replicas stay bit-identical, and bad grids fail before any collective.
Eight ranks share two cores here, so the models are tiny and the runs short."""
import json
import os
import sys

from functools import partial

import pytest
import torch

import parallel_3d
import pipeline_microbatch as pm
from mp.pp.schedules import schedule_actions
import tensor_parallel as tp
from mp.models import build_model
from mp.data import load_data
from helpers import FAST, ROOT, assert_one_error_line, assert_same_losses, flags_id, launch, slow
from mp.check import check_one_step
from mp.dist import torchrun_env
from mp.pp.training import check_step

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_3d  # noqa: E402

MLP = FAST + ["--model", "mlp", "--hidden", "32", "--batch-size", "16", "--steps", "4"]
VIT = FAST + ["--model", "vit", "--hidden", "16", "--heads", "2", "--layers", "2", "--batch-size", "8", "--steps", "3"]
CNN = FAST + ["--model", "cnn", "--batch-size", "16", "--steps", "3"]
IDENTICAL = ("parameters bit-identical across the {dp} replicas of every stage: yes",
             "replicated parameters bit-identical across the {tp} tensor-parallel ranks: yes")


def run_grid(tmp_path, args, dp, pp, tp, extra=()):
    run = launch("parallel_3d.py", args + ["--dp", str(dp), "--tp", str(tp), *extra], tmp_path, nproc=dp * pp * tp)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def assert_replicas_identical(run, dp, tp):
    """Each group of two or more ranks says yes; a group of one has nothing to compare and says nothing."""
    for line, size in zip(IDENTICAL, (dp, tp)):
        if size > 1:
            assert line.format(dp=dp, tp=tp) in run.stdout, run.stdout[-2000:]
        else:
            claim = line.split(" across")[0] + " across"
            assert not any(printed.startswith(claim) for printed in run.stdout.splitlines()), run.stdout[-2000:]


@pytest.mark.slow
def test_2x2x2_cnn_sends_shards_equals_the_baseline_and_moves_the_bytes_of_the_formula(tmp_path, baseline,
                                                                                        monkeypatch):
    """5 blocks over 2 stages: the cut falls after fc1, column-parallel: each tp rank sends its 60 of 120.
    Run under benchmarks/bench_3d.py's counting wrappers (transparent): the bytes each rank moves per
    step on each axis are those of the formula in docs/parallel_3d.md."""
    monkeypatch.setenv("TRAFFIC_DIR", str(tmp_path))
    run = launch("benchmarks/bench_3d.py", ["traffic", *CNN, "--dp", "2", "--tp", "2", "--microbatches", "2"],
                 tmp_path, nproc=8, log_name="parallel_3d.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tensor([[[0, 1],\n         [2, 3]],\n\n        [[4, 5],\n         [6, 7]]])" in run.stdout
    assert "tp groups (one stage's layers split, collectives in every layer): [0, 1] [2, 3] [4, 5] [6, 7]" in run.stdout
    assert "pp groups" in run.stdout and ": [0, 2] [1, 3] [4, 6] [5, 7]" in run.stdout
    assert "dp groups" in run.stdout and ": [0, 4] [1, 5] [2, 6] [3, 7]" in run.stdout
    assert "per-sample message at each cut, on tp rank 0: [60]" in run.stdout
    print(f"2x2x2 cnn: largest |loss - baseline| {assert_same_losses(run, baseline(CNN)):.2g}")   # pytest -s
    assert_replicas_identical(run, 2, 2)
    config, = run.events("config")
    assert (config["program"], config["world_size"], config["args"]["dp"], config["args"]["tp"]) == \
        ("parallel_3d", 8, 2, 2)
    formula, steps = bench_3d.cnn_formula(16 // 2, 2), 3
    for rank in range(8):
        assert bench_3d.counted(tmp_path, rank, steps) == {axis: formula[axis][rank // 2 % 2] for axis in formula}


@pytest.mark.parametrize("args,dp,pp,tp,extra,message", [
    # 1x2x2 vit: whole activations at the cut (a block ends in a row-parallel layer), so each tp rank sends
    # half of the flattened 64 x 16 (scatter/gather), with evaluation, a timeline, and --recompute (its
    # forwards re-run before each backward, tp collectives and the cut's all-gather included)
    (VIT, 1, 2, 2, ["--schedule", "gpipe", "--microbatches", "2", "--eval-every", "2", "--timeline", "t.json",
                    "--recompute"],
     "[512]"),
    # 2x2x2 vit, --sequence-parallel, interleaved with 2 chunks of one block each: every cut carries my
    # 32 of the 64 tokens, and the evaluation too
    (VIT + ["--layers", "6", "--dropout", "0.1", "--clip-grad-norm", "0.5"], 2, 2, 2,
     ["--sequence-parallel", "--schedule", "interleaved", "--microbatches", "2"],
     "[32, 16], [32, 16], [32, 16]"),
    # 2x1x2 mlp with an odd layer count: the classifier is column-parallel with a gather; one stage, no messages
    slow(MLP + ["--layers", "3"], 2, 1, 2, ["--microbatches", "2"], "none (one stage)"),
    # 2x2x1: the joint program's grid with a tp axis of one; interleaved, 2 chunks per rank
    slow(MLP + ["--layers", "4"], 2, 2, 1, ["--schedule", "interleaved", "--microbatches", "2"], "[32], [32], [32]"),
    # 1x2x3 mlp, cut after the first (column-parallel) layer: uneven shards 11, 11, 10 sent tp rank to tp rank
    slow(MLP + ["--layers", "4"], 1, 2, 3, ["--balance", "1,3"], "[11]"),
])
def test_grids_and_models_equal_the_baseline(tmp_path, baseline, args, dp, pp, tp, extra, message):
    run = run_grid(tmp_path, args, dp, pp, tp, extra)
    assert f"per-sample message at each cut, on tp rank 0: {message}\n" in run.stdout
    base = baseline(args + (["--eval-every", "2"] if "--eval-every" in extra else []))
    print(f"{dp}x{pp}x{tp} {args[args.index('--model') + 1]}: largest |loss - baseline| "
          f"{assert_same_losses(run, base):.2g}")
    assert_replicas_identical(run, dp, tp)
    if "--eval-every" in extra:
        assert [e["test_acc"] for e in run.events("eval")] == [e["test_acc"] for e in base.events("eval")] != []
        with open(tmp_path / "t.json") as f:
            trace = json.load(f)
        assert trace["otherData"]["stages"] == pp and trace["otherData"]["recompute"] == ("--recompute" in extra)
        assert {"R0", "R1"} <= {e["name"] for e in trace["traceEvents"]}, "no recomputed forward on the timeline"


@pytest.mark.parametrize("args,extra,formula,message", [
    (VIT, ["--sequence-parallel"], partial(bench_3d.vit_formula, 8, 2, 16, 2, sequence_parallel=True), "[32, 16]"),
    slow(VIT, [], partial(bench_3d.vit_formula, 8, 2, 16, 2), "[512]"),
    slow(VIT, ["--no-scatter-gather"], partial(bench_3d.vit_formula, 8, 2, 16, 2, scatter_gather=False), "[64, 16]"),
    slow(MLP + ["--layers", "4"], [], partial(bench_3d.mlp_formula, 16, 2, 32), "[16]"),
    slow(MLP + ["--layers", "4"], ["--no-scatter-gather"], partial(bench_3d.mlp_formula, 16, 2, 32, scatter_gather=False),
     "[32]"),
])
def test_each_cut_moves_the_bytes_of_the_formula_and_keeps_the_baseline(tmp_path, baseline, monkeypatch, args,
                                                                        extra, formula, message):
    """1x2x2, under bench_3d.py's counting wrappers: a cut that follows a row-parallel layer sends 1/t of
    the activation by default (scatter/gather) and the receivers all-gather it; --sequence-parallel sends
    the token shard and needs no gather; --no-scatter-gather sends it whole. The bytes each rank moves
    per step on each axis are the formula's, and the losses the baseline's."""
    monkeypatch.setenv("TRAFFIC_DIR", str(tmp_path))
    run = launch("benchmarks/bench_3d.py", ["traffic", *args, "--dp", "1", "--tp", "2", "--microbatches", "2", *extra],
                 tmp_path, nproc=4, log_name="parallel_3d.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"per-sample message at each cut, on tp rank 0: {message}\n" in run.stdout
    assert_same_losses(run, baseline(args))
    assert_replicas_identical(run, 1, 2)
    want, steps = formula(), int(args[args.index("--steps") + 1])
    for rank in range(4):
        assert bench_3d.counted(tmp_path, rank, steps) == {axis: want[axis][rank // 2] for axis in want}, rank


def test_the_pipeline_axis_moves_t_times_fewer_bytes_with_either_option():
    """The formulas' pipeline bytes (less the gradient norm's 8) at t = 2 and 4: whole, then 1/t."""
    for t in (2, 4):
        whole, scattered, tokens = (bench_3d.vit_formula(8, t, 16, 2, **kw)["pp"][0] - 8 for kw in
                                    ({"scatter_gather": False}, {}, {"sequence_parallel": True}))
        assert whole == t * scattered == t * tokens == 4 * 8 * 64 * 16
    whole, scattered = (bench_3d.mlp_formula(16, 2, 32, scatter_gather=sg)["pp"][1] - 8 for sg in (False, True))
    assert whole == 2 * scattered == 4 * 16 * 32


@pytest.mark.parametrize("args,extra,message", [
    (VIT, ["--sequence-parallel", "--dropout", "0.1", "--clip-grad-norm", "0.5"], "[32, 16]"),
    (MLP + ["--layers", "4"], [], "[16]"),
])
def test_check_passes_across_a_scattered_or_sequence_parallel_cut(tmp_path, args, extra, message):
    """1x2x2 --check: the vit --sequence-parallel with dropout and clipping (every partial gradient summed
    over the tp group after the last microbatch), and the mlp whose cut follows a row-parallel layer
    (scatter/gather: half the features sent, all-gathered, and half the gradient sent back)."""
    run = run_grid(tmp_path, args, 1, 2, 2, ["--check", "--microbatches", "2", *extra])
    assert f"per-sample message at each cut, on tp rank 0: {message}\n" in run.stdout
    summary = [line for line in run.stdout.splitlines() if line.startswith("--check")]
    assert len(summary) == 1 and "all tensors match the full model" in summary[0], run.stdout[-2000:]


def test_check_compares_every_shard_across_a_sharded_cut(tmp_path):
    """2x2x2 mlp, cut right after the column-parallel first layer (--balance 1,3): the 16-feature shards
    cross the cut; every rank's local gradients (averaged over the replicas) and weights after one step
    match their slices of the full model."""
    run = run_grid(tmp_path, MLP + ["--layers", "4"], 2, 2, 2, ["--check", "--balance", "1,3", "--microbatches", "2"])
    assert "per-sample message at each cut, on tp rank 0: [16]" in run.stdout
    summary = [line for line in run.stdout.splitlines() if line.startswith("--check")]
    assert len(summary) == 1 and "all tensors match the full model" in summary[0], run.stdout[-2000:]
    # stage 0 holds layer 0 (weight, bias), stage 1 layers 1-3 (6 tensors): a gradient and a weight each,
    # plus output and loss on the 4 last-stage ranks: 4 x 4 + 4 x 14
    assert "72 tensors compared" in summary[0], summary[0]


@pytest.mark.parametrize("argv,world,message", [
    (["--dp", "2", "--tp", "2"], 6, "error: the world size 6 is not divisible by --dp 2 x --tp 2 = 4: "
     "launch dp x stages x tp processes; use 4 ranks (torchrun --nproc-per-node 4) or 8 ranks"),
    (["--dp", "1", "--tp", "0"], 4, "error: --dp 1 and --tp 0 must be positive integers"),
    (["--model", "vit", "--heads", "3", "--hidden", "48", "--dp", "1", "--tp", "2"], 4,
     "error: --heads 3 is not divisible by the tensor-parallel degree 2; each rank needs whole heads: "
     "use --heads 2 or --heads 4 or --tp 3 with 6 ranks (torchrun --nproc-per-node 6)"),
    (["--model", "cnn", "--dp", "1", "--tp", "8"], 8,
     "error: the tensor-parallel degree 8 exceeds the 6 output channels of cnn conv1; every rank needs at "
     "least one: use at most --tp 6 with 6 ranks (torchrun --nproc-per-node 6)"),
    (["--layers", "2", "--dp", "1", "--tp", "2"], 6, "error: 3 pipeline stages but the mlp has only 2 blocks "
     "(one chunk needs at least one); use 4 ranks (torchrun --nproc-per-node 4) or --layers 3"),
    (["--dp", "2", "--tp", "2", "--microbatches", "3"], 8,
     "error: --batch-size 16 is not divisible by 2 replicas x --microbatches 3"),
    (["--dp", "1", "--tp", "2", "--sequence-parallel"], 4,
     "error: --sequence-parallel shards the vit's sequence of 64 tokens, and --model mlp has no sequence: "
     "use --model vit, or drop --sequence-parallel"),
    (["--model", "vit", "--heads", "6", "--hidden", "48", "--dp", "1", "--tp", "3", "--sequence-parallel"], 6,
     "error: the vit's 64 tokens are not divisible by the tensor-parallel degree 3; under --sequence-parallel "
     "every rank holds an equal run of tokens: use --tp 2 with 4 ranks (torchrun --nproc-per-node 4) or --tp 4 "
     "with 8 ranks (torchrun --nproc-per-node 8), or drop --sequence-parallel"),
])
def test_a_bad_grid_is_one_error_line_and_exit_2(monkeypatch, capsys, argv, world, message):
    base = MLP if "cnn" not in argv else FAST + ["--batch-size", "16", "--steps", "4"]   # the cnn takes no --hidden
    assert_one_error_line(parallel_3d.parse_args, base + argv, world, message, monkeypatch, capsys)


def test_a_bad_grid_under_torchrun_fails_on_every_rank(tmp_path):
    run = launch("parallel_3d.py", MLP + ["--dp", "2", "--tp", "2"], tmp_path, nproc=2, timeout=60)
    assert run.returncode != 0
    assert run.stderr.count("error: the world size 2 is not divisible by --dp 2 x --tp 2 = 4") == 1, run.stderr
    assert run.exited(2) and 'parallel_3d.py", line' not in run.stderr


def test_check_compares_each_tensor_with_the_slice_it_holds(monkeypatch):
    """In one process (tp 1, one stage): check_one_step passes on tensor-parallel blocks, each compared
    with its slice of the full model (mp.models.full_slice), and names a gradient that differs
    when the reference's weights are not the ones the stage started from."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = parallel_3d.parse_args(MLP + ["--layers", "3", "--dp", "1", "--tp", "1", "--microbatches", "2"])
    x, y = load_data(args).batch(0, args.batch_size)
    pos = pm.PipelineRank(0, 1, [0])

    def check(reference):
        shard = partial(tp.parallelize_block, model_name="mlp", group=None, n_blocks=3)
        env = torchrun_env("gloo")
        model, runner = pm.setup_stage(args, env, pos, shard)
        step = check_step(runner, schedule_actions("1f1b", pos, 2), 2, pm.forward_backward)
        return check_one_step(args, model, step, x, y, reference=reference)

    results = check(build_model(args))
    assert len(results) == 2 + 2 * 6 and max(d for _, d, _ in results) < 1e-5
    assert not [what for what, _, error in results if error]
    wrong = build_model(args)
    with torch.no_grad():
        wrong.get_parameter("2.0.weight").mul_(1.01)     # the last layer: block 0's gradient differs through it
    assert "gradient of 0.1.weight" in [what for what, _, error in check(wrong) if error]


@pytest.mark.parametrize("args,extra", [
    (MLP + ["--layers", "4", "--dropout", "0.1", "--clip-grad-norm", "0.15"], []),
    slow(VIT + ["--dropout", "0.1", "--clip-grad-norm", "0.15"], ["--sequence-parallel"])])
def test_zbv_carries_over_to_the_grid(tmp_path, baseline, args, extra):
    """--schedule zbv on a 1x2x2 grid: 4 chunks in a V over 2 stages of 2 tp ranks each. The V's tip
    hands its activation from chunk a to chunk b on the same tp rank (whole, or its run of tokens under
    --sequence-parallel: what chunk b expects), so no cut is scattered there; the baseline's losses."""
    run = run_grid(tmp_path, args, 1, 2, 2, ["--schedule", "zbv", "--microbatches", "2", *extra])
    assert_same_losses(run, baseline(args))
    assert_replicas_identical(run, 1, 2)


@pytest.mark.parametrize("args,extra", [(MLP + ["--layers", "4"], []), slow(VIT, ["--sequence-parallel"]),
                                        slow(CNN, ["--no-scatter-gather"])])
def test_zb_splits_the_sharded_layers_and_keeps_the_baseline(tmp_path, baseline, args, extra):
    """--schedule zb on a 1x2x2 grid: real W actions on the tensor-parallel shards (their time on
    the timeline, not the empty ones of an unsplit backward), and the baseline's losses."""
    run = run_grid(tmp_path, args, 1, 2, 2, ["--schedule", "zb", "--timeline", str(tmp_path / "t.json"), *extra])
    assert_same_losses(run, baseline(args))
    with open(tmp_path / "t.json") as f:
        events = json.load(f)["traceEvents"]
    time = {kind: sum(e["dur"] for e in events if e["cat"] == kind) for kind in ("backward", "weight")}
    # B holds the tp collectives (and, 4 ranks on 2 cores, their waits for a core): W measured 6-9% of
    # it on a quiet machine, 2% beside another test file's ranks (pytest -n 2); an unsplit backward's W
    # actions are empty (about 0.1%, 1 us against B's 800 us)
    assert time["weight"] > 0.005 * time["backward"], time


@pytest.mark.parametrize("pp,extra", [
    (1, ["--sequence-parallel", "--zero", "2", "--schedule", "1f1b"]),   # the norms' partial sums: late buckets
    slow(2, ["--zero", "1", "--schedule", "zbv"]),
], ids=flags_id)
def test_several_buckets_a_stage_keep_the_baseline_step_by_step(tmp_path, baseline, pp, extra):
    """--bucket-mb 0.002: several buckets a stage, a weight above the cap alone (qkv's 16 x 48 slice of 16 x 24
    per tp rank is 1.5 KB; the mlp's 16 x 64, 2 KB), the sequence-parallel partial sums in late buckets of their
    own; loss and norm within 1e-6 a step of the baseline (issue 82)."""
    args = VIT + ["--layers", "4", "--microbatches", "2", "--dropout", "0.1", "--clip-grad-norm", "0.5"]
    run = run_grid(tmp_path, args, 2, pp, 2, [*extra, "--bucket-mb", "0.002"])
    got, want = run.events("train"), baseline(args).events("train")
    assert len(got) == len(want) == 3
    assert max(abs(a["loss"] - b["loss"]) + abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, want)) <= 1e-6
