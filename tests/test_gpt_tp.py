"""tensor_parallel.py --model gpt: the vocabulary-parallel cross-entropy against F.cross_entropy, no rank
holding the [b, s, V] logits, the program against the baseline step by step (with and without
--sequence-parallel, tied or not), its --check, and the bad input."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import tensor_parallel as tp
from helpers import FAST, assert_one_error_line, assert_same_losses, launch, run_ranks, slow
from mp.loss import token_sum
from mp.models import build_model
from mp.sizes import VOCAB
from mp.text import IGNORE
from mp.tp.vocab import vocab_parallel_argmax, vocab_parallel_cross_entropy, vocab_parallel_token_sum

GPT = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16"]
EXACT = ["--steps", "6", "--batch-size", "16", "--loss-mask", "prefix", "--dropout", "0.1", "--clip-grad-norm", "1",
         "--optimizer", "adamw"]


def case_cross_entropy(rank, world, group):
    """Each token's loss and the gradient of my columns against F.cross_entropy of the whole logits, with
    IGNORE targets and targets on every rank; the token sum in F.cross_entropy's order; argmax with ties."""
    torch.manual_seed(0)                       # the same whole logits on every rank
    full = (3 * torch.randn(4, 8, VOCAB)).requires_grad_()
    targets = torch.randint(VOCAB, (4, 8))
    targets[:, :3] = IGNORE
    upstream = torch.randn(4, 8)
    F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none").view(4, 8) \
        .backward(upstream)
    want = F.cross_entropy(full.detach().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    n = VOCAB // world
    mine = full.detach()[..., rank * n:(rank + 1) * n].clone().requires_grad_()
    losses = vocab_parallel_cross_entropy(mine, targets, group)
    losses.backward(upstream)
    assert_close(losses, want.view(4, 8), msg="each token's loss")
    assert (losses[:, :3] == 0).all() and (mine.grad[:, :3] == 0).all(), "IGNORE: no loss, no gradient"
    assert_close(mine.grad, full.grad[..., rank * n:(rank + 1) * n], msg="the gradient of my columns")
    assert_close(vocab_parallel_token_sum(mine.detach(), targets, group), token_sum(full.detach(), targets))
    tied = full.detach().clone()
    tied[..., 5] = tied[..., n + 7] = tied.max() + 1          # the same largest value on ranks 0 and 1
    got = vocab_parallel_argmax(tied[..., rank * n:(rank + 1) * n], group)
    assert torch.equal(got, tied.argmax(-1)) and (got == 5).all(), "argmax: the first of equal values"


@pytest.mark.parametrize("world", [2, slow(4)])
def test_the_vocabulary_parallel_cross_entropy_is_f_cross_entropy(tmp_path, world):
    run_ranks(case_cross_entropy, world, tmp_path)


class Largest(TorchDispatchMode):
    """Records the shape of every tensor an operation makes (forward, backward, inside autograd functions)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor)]
        return out


def largest_tensors(model, x, loss_fn):
    """The element count of the largest tensor one step makes, and every shape it made."""
    with Largest() as seen:
        loss_fn(model(x), x).backward()
    return max(torch.Size(s).numel() for s in seen.shapes), seen.shapes


def case_no_full_logits(rank, world, group):
    """The whole step (forward, loss, backward) of a rank makes no [b, s, V] tensor: the largest it makes is
    its logits, b x s x V/T elements; the same detector finds b x s x V in the full model (a test that can fail)."""
    b, s = 8, 16
    x = torch.randint(VOCAB, (b, s))
    for flags in (["--tie-embeddings"], ["--sequence-parallel"]):
        args = tp.parse_args(FAST + GPT + flags)
        full = build_model(args)
        biggest, _ = largest_tensors(full, x, lambda logits, y: logits.sum())
        assert biggest == b * s * VOCAB, biggest
        model = tp.parallelize(build_model(args), "gpt", group, sequence_parallel=args.sequence_parallel, tokens=s)
        biggest, shapes = largest_tensors(model, x, lambda logits, y: vocab_parallel_token_sum(logits, y, group))
        assert biggest == b * s * VOCAB // world and (b, s, VOCAB // world) in shapes, (biggest, flags)
        names = [name for name, _ in model.named_parameters()]
        assert ("3.weight" in names) != args.tie_embeddings, names   # tied: one Parameter, "0.tok.weight"
        assert model[0].tok.weight.shape == (VOCAB // world, 32) and model[0].tok.shards["weight"][1] == rank * 128
        assert (model[3].weight is model[0].tok.weight) == args.tie_embeddings


def test_no_rank_holds_the_full_logits(tmp_path):
    run_ranks(case_no_full_logits, 2, tmp_path)


def assert_exact(run, reference):
    """Within 1e-6 a step in the loss and the gradient norm (relative), and the same evaluation."""
    assert_same_losses(run, reference, atol=1e-6)
    for got, want in zip(run.events("train"), reference.events("train")):
        assert abs(got["grad_norm"] / want["grad_norm"] - 1) < 1e-6, (got, want)
    (got,), (want,) = run.events("eval"), reference.events("eval")
    assert abs(got["test_loss"] - want["test_loss"]) < 1e-6 and abs(got["test_acc"] - want["test_acc"]) < 1e-3
    assert abs(got["test_bits_per_byte"] - want["test_bits_per_byte"]) < 2e-6


@pytest.mark.parametrize("flags", [["--tie-embeddings"], ["--sequence-parallel"],
                                   slow(["--tie-embeddings", "--sequence-parallel"]), slow([])])
def test_the_gpt_under_tensor_parallelism_is_the_baseline(tmp_path, baseline, flags):
    args = FAST + GPT + EXACT + ["--eval-every", "6"] + flags   # one evaluation, after the last step
    run = launch("tensor_parallel.py", args, tmp_path, nproc=2)
    assert_exact(run, baseline([a for a in args if a != "--sequence-parallel"]))
    assert "replicated parameters bit-identical across the 2 tensor-parallel ranks: yes" in run.stdout


@pytest.mark.parametrize("flags", [["--tie-embeddings", "--sequence-parallel"], slow([])])
def test_the_gpt_check_matches_the_full_model(tmp_path, flags):
    # SGD: AdamW's first step divides the gradient of attention's key bias, which the softmax makes 0 up to
    # rounding, by its own size, so that noise of 1e-10 moves the bias by 1e-5 in any layout (the vit's too)
    run = launch("tensor_parallel.py", FAST + GPT + ["--check", "--loss-mask", "prefix", "--dropout", "0.1",
                                                     "--clip-grad-norm", "1"] + flags, tmp_path, nproc=2)
    assert run.returncode == 0 and "all tensors match the full model" in run.stdout, run.stdout + run.stderr[-2000:]


@pytest.mark.parametrize("argv, world, message", [
    (GPT[:4] + ["--hidden", "48", "--heads", "3"], 3, "error: the gpt's vocabulary of 256 bytes is not divisible by "
                                                      "the tensor-parallel degree 3"),
    (GPT[:-1] + ["15", "--sequence-parallel"], 2, "error: --seq-len 15 is not divisible by the tensor-parallel "
                                                   "degree 2"),
])
def test_bad_gpt_input_is_one_error_line(argv, world, message, monkeypatch, capsys):
    assert_one_error_line(tp.parse_args, ["--data", "synthetic"] + argv, world, message, monkeypatch, capsys)
