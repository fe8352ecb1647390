"""tensor_parallel.py --hybrid (Krizhevsky's one weird trick): the program against the baseline step by
step, --check, the collectives of one step counted, the replicated conv weights identical on every
rank, the bad inputs, run_tp.sh's HYBRID=1 knob and benchmarks/tp_hybrid.py."""
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

import tensor_parallel as tp
from mp.models import build_model
from mp.optim import make_optimizer
from helpers import FAST, ROOT, assert_same_losses, launch, run_ranks, slow
from test_launchers import launcher

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tp_hybrid  # noqa: E402  (benchmarks/tp_hybrid.py: its collective counter)

ARGS = FAST + ["--batch-size", "16", "--steps", "8"]


@pytest.mark.parametrize("nproc", [2, slow(4)])
def test_hybrid_logs_the_baseline_losses(tmp_path, baseline, nproc):
    run = launch("tensor_parallel.py", ARGS + ["--hybrid"], tmp_path, nproc=nproc)
    worst = assert_same_losses(run, baseline(ARGS))
    print(f"hybrid at degree {nproc}: largest |loss difference| {worst:.2g}")
    config, = run.events("config")
    assert config["args"]["hybrid"] is True and config["world_size"] == nproc


def test_hybrid_check_flag_matches(tmp_path):
    run = launch("tensor_parallel.py", FAST + ["--batch-size", "16", "--hybrid", "--check"], tmp_path, nproc=4)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "12 local gradients" in run.stdout and "all tensors match the full model" in run.stdout, run.stdout


def hybrid_and_full(group):
    args = tp.parse_args(FAST + ["--hybrid", "--batch-size", "8"])
    return args, tp.parallelize(build_model(args), "cnn", group, hybrid=True), build_model(args)


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)  # the same batch on every rank
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(10, (n,), generator=g)


def case_collectives(rank, world, group):
    """One step of hybrid: the all-gather of the features, the fc layers' collectives, one bucket of
    conv gradients; fewer bytes than plain tensor parallelism of the same cnn."""
    args, model, full = hybrid_and_full(group)
    b = args.batch_size
    calls = tp_hybrid.collectives_of_one_step(model, *batch(b, 0))
    assert calls == [("forward", "all_gather", b * 400),      # conv features, along the batch
                     ("forward", "all_reduce", b * 84),       # g after fc2
                     ("forward", "all_gather", b * 10),       # the logits (fc3's 10 outputs: even over 2)
                     ("backward", "all_reduce", b * 84),      # f before fc3
                     ("backward", "all_reduce", b * 400),     # f before fc1
                     ("backward", "all_reduce", 2904)], calls  # the conv gradients, one bucket
    plain = tp_hybrid.collectives_of_one_step(tp.parallelize(full, "cnn", group), *batch(b, 0))
    assert plain[0] == ("forward", "all_reduce", b * 16 * 10 * 10) and len(plain) == 5, plain
    ring = 4 * (world - 1) / world  # bytes per element a rank sends in a ring all-gather; twice that in an all-reduce
    assert tp_hybrid.bytes_per_rank(calls, world) == ring * (3 * b * 400 + 4 * b * 84 + b * 10 + 2 * 2904)
    assert tp_hybrid.bytes_per_rank(plain, world) == ring * (2 * b * 1600 + 4 * b * 84 + b * 10 + 2 * b * 400)


def test_collectives_of_one_hybrid_step(tmp_path):
    run_ranks(case_collectives, 2, tmp_path)


def case_replicated_conv_weights(rank, world, group):
    """After a few steps the replicated conv weights are bit-identical on every rank and match the full
    model trained in this process; a test chunk the degree does not divide (10 over 4) still works."""
    args, model, full = hybrid_and_full(group)
    opt, full_opt = make_optimizer(model.parameters(), args), make_optimizer(full.parameters(), args)
    for step in range(3):
        x, y = batch(args.batch_size, step)
        for m, o in ((model, opt), (full, full_opt)):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            tp.sync_tp_grads(getattr(m, "partial_grads", None), None)   # as tensor_parallel.train_step does
            o.step()
    conv = [(n, p) for n, p in model.named_parameters() if n.startswith(("0.", "1."))]
    assert len(conv) == 6  # conv1, conv2 and the GroupNorm, weight and bias each
    for name, p in conv:
        every = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(every, p.detach().contiguous())
        assert all(torch.equal(every[0], q) for q in every), f"{name} differs between ranks"
        assert_close(p, full.get_parameter(name), msg=f"{name} against the full model")
    with torch.no_grad():
        x, _ = batch(10, 9)
        assert_close(model(x), full(x), msg="logits of 10 samples over 4 ranks (3, 3, 2, 2)")


def test_replicated_conv_weights_stay_identical_on_every_rank(tmp_path):
    run_ranks(case_replicated_conv_weights, 4, tmp_path)


@pytest.mark.parametrize("argv,world,message", [
    (["--batch-size", "10"], 4, "error: --batch-size 10 is not divisible by the tensor-parallel degree 4; "),
    (["--model", "mlp"], 2, "error: --hybrid runs the cnn's convolutions data-parallel, and --model mlp has no "),
])
def test_bad_hybrid_input_is_one_error_line_and_exit_2(tmp_path, monkeypatch, argv, world, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # what torchrun tells each rank; no collective is reached
    run = launch("tensor_parallel.py", ["--data", "synthetic", "--hybrid"] + argv, tmp_path)
    assert run.returncode == 2 and run.stderr.startswith(message), run.stderr
    assert run.stderr.count("\n") == 1


@pytest.mark.slow   # run_tp.sh itself is in the quick subset (tests/test_launchers.py)
def test_run_tp_draws_hybrid_beside_plain_tensor_parallelism(tmp_path):
    run = launcher("run_tp.sh", tmp_path, STEPS="3", NPROC="2", HYBRID="1", BATCH_SIZE="16",
                   PLOTS=str(tmp_path / "plots"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "plots" / "tp_loss_batchsize16_hybrid1_steps3_synthetic_evalevery0.png").stat().st_size > 10_000
    assert "largest |loss - baseline| for tensor_parallel (2 ranks, batch 16)" in run.stdout, run.stdout
    assert "largest |loss - baseline| for tensor_parallel (hybrid, 2 ranks, batch 16)" in run.stdout, run.stdout


def test_benchmark_counts_and_times_both(tmp_path):
    out = tmp_path / "hybrid.json"
    run = launch("benchmarks/tp_hybrid.py", ["--out", str(out), "--batch-size", "16", "--warmup", "1",
                                             "--repeat", "2"], tmp_path, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [len(result["collectives"][n]["calls"]) for n in ("tp", "hybrid")] == [5, 6]
    assert set(result["median_step_s"]) == {"baseline", "tp", "hybrid"} and result["paired_hybrid_over_tp"] > 0
    assert max(result["max_loss_diff_vs_baseline"].values()) < 1e-4, result
