"""Tensor parallelism: each parallel layer against its full layer, against torch's own tensor parallelism,
the collectives of one step counted, and the program against the baseline step by step."""
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import tensor_parallel as tp
from mp.check import check_one_step
from mp import models
from mp.models import build_model
from mp.tp import collectives
from helpers import FAST, ROOT, assert_same_losses, launch, run_ranks, slow

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from sequence_parallel import collectives_of_one_step  # noqa: E402


def full_and_parallel(make_full, make_parallel, group):
    torch.manual_seed(0)  # the same full layer on every rank
    full = make_full()
    return full, make_parallel(copy.deepcopy(full), group)


def check_layer(full, layer, x, split_input, split_output, dim, group):
    """Output, input gradient, weight and bias gradients of one parallel layer against its full layer."""
    x_full = x.clone().requires_grad_()
    y_full = full(x_full)
    torch.manual_seed(1)
    grad_y = torch.randn_like(y_full)  # the same upstream gradient on every rank
    y_full.backward(grad_y)
    sizes = layer.sizes
    start, n = sum(sizes[:dist.get_rank(group)]), sizes[dist.get_rank(group)]
    x_local = (x.narrow(dim, start, n) if split_input else x).clone().requires_grad_()
    y = layer(x_local)
    y.backward(grad_y.narrow(dim, start, n) if split_output else grad_y)
    assert_close(y, y_full.narrow(dim, start, n) if split_output else y_full, msg="output")
    assert_close(x_local.grad, x_full.grad.narrow(dim, start, n) if split_input else x_full.grad,
                 msg="input gradient")
    for name, p in layer.named_parameters():
        assert_close(p.grad, models.full_slice(layer, name, full.get_parameter(name).grad), msg=f"{name} gradient")


def case_layers(rank, world, group):
    """Each layer on shards that are uneven at degree 4 (10 -> 3,3,2,2 and 6 -> 2,2,1,1)."""
    torch.manual_seed(2)
    x, image = torch.randn(4, 7), torch.randn(2, 6, 9, 9)
    for gather in (False, True):
        full, layer = full_and_parallel(lambda: nn.Linear(7, 10), lambda f, g: tp.ColumnParallelLinear(
            f, g, gather_output=gather), group)
        check_layer(full, layer, x, False, not gather, -1, group)
        full, layer = full_and_parallel(lambda: nn.Conv2d(6, 6, 3, padding=1), lambda f, g: tp.ColumnParallelConv2d(
            f, g, gather_output=gather), group)
        check_layer(full, layer, image, False, not gather, 1, group)
    full, layer = full_and_parallel(lambda: nn.Linear(10, 5), tp.RowParallelLinear, group)
    check_layer(full, layer, torch.randn(4, 10), True, False, -1, group)
    full, layer = full_and_parallel(lambda: nn.Conv2d(6, 4, 3, stride=2), tp.RowParallelConv2d, group)
    check_layer(full, layer, image, True, False, 1, group)
    if world == 4:
        assert layer.sizes == [2, 2, 1, 1]


@pytest.mark.parametrize("world", [2, 4])
def test_each_parallel_layer_matches_its_full_layer(tmp_path, world):
    run_ranks(case_layers, world, tmp_path)


def case_dtensor(rank, world, group):
    """The same column | row pair through torch.distributed.tensor.parallel, as an independent oracle."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 5))
    mine = nn.Sequential(tp.ColumnParallelLinear(full[0], group), nn.GELU(), tp.RowParallelLinear(full[2], group))
    parallelize_module(full, DeviceMesh("cpu", list(range(world))), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(6, 8)
    x_mine, x_torch = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_mine, y_torch = mine(x_mine), full(x_torch)
    y_mine.square().sum().backward()
    y_torch.square().sum().backward()
    assert_close(y_mine, y_torch.wait() if hasattr(y_torch, "wait") else y_torch, msg="output")
    assert_close(x_mine.grad, x_torch.grad, msg="input gradient")
    for name, p in mine.named_parameters():
        want = full.get_parameter(name).grad.full_tensor()  # DTensor: the whole gradient, however it shards
        assert_close(p.grad, models.full_slice(mine, name, want), msg=f"{name} gradient")


def test_matches_torch_distributed_tensor_parallel(tmp_path):
    run_ranks(case_dtensor, 2, tmp_path)


def count_collectives(model, x, y, elements=None):
    """{(phase, collective): calls} of one forward and backward (benchmarks/sequence_parallel.py wraps
    torch.distributed's functions); elements, if given, collects {(phase, collective): elements} of the
    whole tensor each one stands for (an all-reduce's tensor, an all-gather's output list, a
    reduce-scatter's input list)."""
    counted, calls = collectives_of_one_step(model, x, y)
    if elements is not None:
        elements.update({tuple(key.split(" ")): n for key, n in counted.items()})
    return {tuple(key.split(" ")): n for key, n in calls.items()}


COUNTS = [  # model flags, expected (phase, collective) -> calls per training step
    (["--model", "cnn"], {("forward", "all_reduce"): 2, ("forward", "all_gather"): 1, ("backward", "all_reduce"): 2}),
    (["--model", "mlp", "--layers", "4"], {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 1}),
    (["--model", "mlp", "--layers", "3"], {("forward", "all_reduce"): 1, ("forward", "all_gather"): 1,
                                           ("backward", "all_reduce"): 1}),
    (["--model", "vit", "--layers", "2", "--hidden", "32"], {("forward", "all_reduce"): 4,
                                                              ("backward", "all_reduce"): 4}),
]


def case_counts(rank, world, group):
    for flags, expected in COUNTS:
        args = tp.parse_args(["--data", "synthetic"] + flags)
        model = tp.parallelize(build_model(args), args.model, group)
        pairs = sum(isinstance(m, tp._RowParallel) for m in model.modules())
        torch.manual_seed(0)
        counts = count_collectives(model, torch.randn(8, 3, 32, 32), torch.randint(10, (8,)))
        assert counts == expected, (flags, counts)
        assert counts[("forward", "all_reduce")] == pairs, "one forward all-reduce per column | row pair"


def test_collectives_of_one_step_one_forward_all_reduce_per_pair(tmp_path):
    run_ranks(case_counts, 2, tmp_path)


def case_sequence_counts(rank, world, group):
    """--sequence-parallel: each all-reduce of the plain vit becomes a reduce-scatter plus an all-gather of
    the same whole tensor (the bytes stay the same); the head's all-reduce of the pooled B x H and one
    all-reduce of the partial gradients (norms, row-parallel biases, patch embedding) are what it adds."""
    flags = ["--data", "synthetic", "--model", "vit", "--layers", "2", "--hidden", "32"]
    args, b, layers, hidden = tp.parse_args(flags + ["--sequence-parallel"]), 8, 2, 32
    torch.manual_seed(0)
    x, y = torch.randn(b, 3, 32, 32), torch.randint(10, (b,))
    plain, sequence = {}, {}
    count_collectives(tp.parallelize(build_model(args), "vit", group), x, y, plain)
    model = tp.parallelize(build_model(args), "vit", group, sequence_parallel=True)
    counts = count_collectives(model, x, y, sequence)
    tokens = b * 64 * hidden        # one activation of the residual stream, whole
    pairs = 2 * layers              # column | row pairs: attention and MLP of each block
    # ln1, ln2 (weight, bias), the proj and mlp.2 biases; the head's ln; the patch conv and position embedding
    partial = layers * (4 * hidden + 2 * hidden) + 2 * hidden + (3 * 4 * 4 + 1) * hidden + 64 * hidden
    assert plain == {("forward", "all_reduce"): pairs * tokens, ("backward", "all_reduce"): pairs * tokens}, plain
    assert sequence == {("forward", "all_gather"): pairs * tokens, ("forward", "reduce_scatter"): pairs * tokens,
                        ("forward", "all_reduce"): b * hidden, ("backward", "reduce_scatter"): pairs * tokens,
                        ("backward", "all_gather"): pairs * tokens, ("backward", "all_reduce"): partial}, sequence
    assert counts[("forward", "reduce_scatter")] == counts[("backward", "reduce_scatter")] == pairs, counts
    assert counts[("backward", "all_reduce")] == 1, "the partial gradients are summed in one bucket"


def test_sequence_parallel_swaps_each_all_reduce_for_a_reduce_scatter_and_an_all_gather(tmp_path):
    run_ranks(case_sequence_counts, 2, tmp_path)


def case_replicated(rank, world, group):
    """Replicated parameters (norms, row-parallel biases, patch embedding, head) get bit-identical
    gradients and so stay identical on every rank without any all-reduce of their own."""
    args = tp.parse_args(FAST + ["--model", "vit", "--layers", "2", "--hidden", "32", "--lr", "0.05"])
    model = tp.parallelize(build_model(args), args.model, group)
    replicated = [(n, p) for n, p in model.named_parameters() if models.shard_of(model, n) is None]
    assert any("ln1" in n for n, _ in replicated) and any("proj.bias" in n for n, _ in replicated)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
        dist.broadcast(x, 0)
        dist.broadcast(y, 0)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for name, p in replicated:
            every = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(every, p.grad.contiguous())
            assert all(torch.equal(every[0], g) for g in every), f"gradient of {name} differs between ranks"
        optimizer.step()


def test_replicated_parameters_get_the_same_gradient_on_every_rank(tmp_path):
    run_ranks(case_replicated, 2, tmp_path)


def case_check_catches(rank, world, group):
    """check_one_step (the engine of --check) names a tensor that is wrong on one rank."""
    args = tp.parse_args(FAST + ["--model", "cnn"])
    model = tp.parallelize(build_model(args), args.model, group)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
    dist.broadcast(x, 0)
    dist.broadcast(y, 0)
    if rank == 1:
        with torch.no_grad():
            model[3][0].weight[0, 0] += 0.05  # one wrong number in fc2's shard on rank 1
    failed = [what for what, _, error in check_one_step(args, model, None, x, y, norm=([group], None)) if error]
    assert "output" in failed, failed
    assert ("weight of 3.0.weight after one step" in failed) == (rank == 1), failed


def test_check_names_a_wrong_tensor(tmp_path):
    run_ranks(case_check_catches, 2, tmp_path)


def case_flat_collectives(rank, world, group):
    """mp.tp.collectives' flat-buffer gather and scatter against their definitions, with shards that differ
    by one (tensor_split) along each dim: the gather is the cat of every rank's shard, the scatter my
    slice of the sum; both exact (they only move numbers, and the sum is gloo's either way)."""
    torch.manual_seed(0)
    whole = torch.randn(5, 7, 3)                                   # the same on every rank
    for dim in (0, 1, 2, -1):
        sizes = tp.split_sizes(whole.shape[dim], world)
        mine = whole.tensor_split(world, dim)[rank].contiguous()
        assert torch.equal(collectives.all_gather(mine, group, sizes, dim), whole), dim
    parts = torch.randn(world, 4, 2 * world, 3)                    # rank r's own x: parts[r]
    out = collectives.reduce_scatter(parts[rank].clone(), group, 1)
    expected = parts.sum(0).chunk(world, 1)[rank]
    assert_close(out, expected, rtol=0, atol=1e-6)
    assert out.is_contiguous() and out.shape == expected.shape


def test_flat_collectives_gather_uneven_shards_and_scatter_the_sum(tmp_path):
    run_ranks(case_flat_collectives, 3, tmp_path)


def case_f_in_place(rank, world, group):
    """f's backward sums the gradient in place (no copy first): the input and weight gradients of a vit
    block (f's output feeds q, k and v; a residual shares the block's output gradient) and of an mlp's
    column | row pair are bit-identical to those of the copying all-reduce it replaced."""
    torch.manual_seed(0)
    vit = tp.parallelize(build_model(tp.parse_args(FAST + ["--model", "vit", "--layers", "2", "--hidden", "32"])),
                         "vit", group)
    mlp = tp.parallelize(build_model(tp.parse_args(FAST + ["--model", "mlp", "--layers", "4", "--hidden", "32"])),
                         "mlp", group)
    for model, h in ((vit[1], torch.randn(4, 64, 32)), (mlp[2:], torch.randn(4, 32))):
        grads = []
        for copying in (False, True):
            h_in = h.clone().requires_grad_()
            if copying:   # every all-reduce of tensor_parallel.py on a copy, as before
                tp.all_reduce = lambda t, g, in_place=False: collectives.all_reduce(t, g)
            try:
                model(h_in).sum().backward()
            finally:
                tp.all_reduce = collectives.all_reduce
            grads.append([h_in.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*grads)), type(model)


def test_f_sums_its_gradient_in_place_with_the_same_result(tmp_path):
    run_ranks(case_f_in_place, 2, tmp_path)


def test_split_sizes_are_tensor_splits():
    assert tp.split_sizes(6, 4) == [2, 2, 1, 1] and tp.split_sizes(10, 4) == [3, 3, 2, 2]
    assert tp.split_sizes(10, 4) == [len(t) for t in torch.arange(10).tensor_split(4)]


# ----------------------------------------------------------------------------- the program


SMALL = {"cnn": [], "mlp4": ["--model", "mlp", "--hidden", "64", "--layers", "4"],
         "mlp3": ["--model", "mlp", "--hidden", "64", "--layers", "3"],
         "vit": ["--model", "vit", "--hidden", "32", "--layers", "2", "--heads", "4"]}


@pytest.mark.parametrize("model,nproc", [("cnn", 2), slow("cnn", 4), slow("mlp4", 2), slow("mlp3", 4), ("vit", 2),
                                         slow("vit", 4)])
def test_program_logs_the_baseline_losses(tmp_path, baseline, model, nproc):
    args = FAST + SMALL[model] + ["--steps", "12"]
    run = launch("tensor_parallel.py", args, tmp_path, nproc=nproc)
    worst = assert_same_losses(run, baseline(args))
    print(f"{model} at degree {nproc}: largest |loss difference| {worst:.2g}")
    config, = run.events("config")
    assert config["program"] == "tensor_parallel" and config["world_size"] == nproc
    summary, = run.events("summary")
    assert sorted(summary["peak_memory_mb"]) == [str(r) for r in range(nproc)]


def test_eval_records_follow_the_baseline(tmp_path, baseline):
    args = ["--data", "synthetic", "--threads", "1", "--steps", "6", "--eval-every", "3"]
    run, ref = launch("tensor_parallel.py", args, tmp_path, nproc=2), baseline(args)
    assert_same_losses(run, ref)
    assert [e["step"] for e in run.events("eval")] == [e["step"] for e in ref.events("eval")] == [2, 5]
    for got, want in zip(run.events("eval"), ref.events("eval")):
        assert abs(got["test_loss"] - want["test_loss"]) < 1e-4 and abs(got["test_acc"] - want["test_acc"]) <= 1e-3


@pytest.mark.parametrize("model,nproc", [("vit", 2), ("cnn", 4)])
def test_check_flag_matches(tmp_path, model, nproc):
    run = launch("tensor_parallel.py", FAST + SMALL[model] + ["--check"], tmp_path, nproc=nproc)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "largest difference" in run.stdout and "all tensors match the full model" in run.stdout, run.stdout


@pytest.mark.parametrize("argv,world,message", [
    (["--model", "vit", "--heads", "3", "--hidden", "48"], 2,
     "error: --heads 3 is not divisible by the tensor-parallel degree 2; "),
    (["--model", "cnn"], 8, "error: the tensor-parallel degree 8 exceeds the 6 output channels of cnn conv1"),
    (["--model", "vit", "--heads", "6", "--hidden", "48", "--sequence-parallel"], 6,
     "error: the vit's 64 tokens are not divisible by the tensor-parallel degree 6; under --sequence-parallel every "
     "rank holds an equal run of tokens: use 4 ranks (torchrun --nproc-per-node 4) or 8 ranks"),
    (["--model", "mlp", "--sequence-parallel"], 2, "error: --sequence-parallel shards the vit's sequence of 64 "
                                                   "tokens, and --model mlp has no sequence: use --model vit"),
    (["--model", "cnn", "--sequence-parallel"], 2, "error: --sequence-parallel shards the vit's sequence"),
    (["--hybrid", "--sequence-parallel"], 2, "error: --sequence-parallel shards the vit's tokens and --hybrid "),
])
def test_bad_degree_is_one_error_line_and_exit_2_on_each_rank(tmp_path, monkeypatch, argv, world, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # what torchrun tells each rank; no collective is reached
    run = launch("tensor_parallel.py", ["--data", "synthetic"] + argv, tmp_path)
    assert run.returncode == 2 and run.stderr.startswith(message), run.stderr
    assert run.stderr.count("\n") == 1


def test_bad_degree_under_torchrun_fails_on_every_rank(tmp_path):
    run = launch("tensor_parallel.py", ["--data", "synthetic", "--model", "vit", "--heads", "3", "--hidden", "48"],
                 tmp_path, nproc=2, timeout=60)
    assert run.returncode != 0
    assert run.stderr.count("error: --heads 3 is not divisible by the tensor-parallel degree 2") == 1, run.stderr
    assert run.exited(2) and 'tensor_parallel.py", line' not in run.stderr


# ----------------------------------------------------------------------------- --sequence-parallel

# dropout and a clipping norm the gradient exceeds: the token shards' masks and the summed norm gradients
SEQUENCE = FAST + ["--model", "vit", "--hidden", "16", "--heads", "4", "--layers", "2", "--batch-size", "8",
                   "--steps", "6", "--dropout", "0.1", "--clip-grad-norm", "0.1"]


@pytest.mark.parametrize("nproc", [2, slow(4)])
def test_sequence_parallel_logs_the_baseline_losses_and_norms(tmp_path, baseline, nproc):
    run = launch("tensor_parallel.py", SEQUENCE + ["--sequence-parallel"], tmp_path, nproc=nproc)
    reference = baseline(SEQUENCE)
    worst = assert_same_losses(run, reference)
    norms = [(r["grad_norm"], w["grad_norm"]) for r, w in zip(run.events("train"), reference.events("train"))]
    assert max(abs(a - b) for a, b in norms) <= 1e-4, norms
    assert sum(b > 0.1 for _, b in norms) >= len(norms) // 2, f"clipping was not active: {norms}"
    assert run.events("config")[0]["args"]["sequence_parallel"] is True
    print(f"sequence parallel at degree {nproc}: largest |loss difference| {worst:.2g}")


def test_sequence_parallel_check_matches(tmp_path):
    run = launch("tensor_parallel.py", SEQUENCE + ["--sequence-parallel", "--check"], tmp_path, nproc=2)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "all tensors match the full model" in run.stdout, run.stdout


def case_sequence_shards(rank, world, group):
    """Under --sequence-parallel the residual stream holds my 64/world tokens, the parameters applied to my
    tokens only are marked for the gradient sum, and the dropouts key their masks with my first token."""
    args = tp.parse_args(FAST + ["--model", "vit", "--layers", "2", "--hidden", "32", "--dropout", "0.1"])
    model = tp.parallelize(build_model(args), "vit", group, sequence_parallel=True)
    tokens = 64 // world
    assert model[0](torch.zeros(2, 3, 32, 32)).shape == (2, tokens, 32)
    assert [m.first_token for m in model.modules() if hasattr(m, "first_token")] == [rank * tokens] * 4
    marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    assert marked == {f"{i}.{m}" for i in (1, 2) for m in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias",
                                                          "attn.proj.bias", "mlp.2.bias")} | {
        "0.conv.weight", "0.conv.bias", "0.pos", "3.ln.weight", "3.ln.bias"}, marked
    assert set(model.partial_grads.params) == {p for n, p in model.named_parameters() if n in marked}


def test_sequence_parallel_shards_the_tokens_and_marks_the_norms(tmp_path):
    run_ranks(case_sequence_shards, 2, tmp_path)
