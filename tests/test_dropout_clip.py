"""Dropout and gradient clipping, exact under every layout (mp/dropout.py, mp/clipping.py).

Every run here has dropout 0.1 and a clipping norm that the gradient exceeds at most steps, and
must log the baseline's per-step loss and gradient norm within 1e-4."""
import pytest
import torch

from mp.clipping import clip_global
from mp.models import build_model
from helpers import FAST, assert_one_error_line, assert_same_losses, launch
from mp.dropout import DropoutKeys, KeyedDropout, keep_mask
from single_baseline import parse_args

CLIP = 0.1
REG = ["--dropout", "0.1", "--clip-grad-norm", str(CLIP)]
MLP = FAST + ["--model", "mlp", "--hidden", "32", "--layers", "5", "--batch-size", "16", "--steps", "8"] + REG
CNN = FAST + ["--model", "cnn", "--batch-size", "16", "--steps", "6"] + REG
VIT = FAST + ["--model", "vit", "--hidden", "16", "--heads", "2", "--layers", "2", "--batch-size", "8",
              "--steps", "4"] + REG


def assert_same_norms(run, reference, atol=1e-4):
    got = [r["grad_norm"] for r in run.events("train")]
    want = [r["grad_norm"] for r in reference.events("train")]
    assert len(got) == len(want) > 0 and max(abs(a - b) for a, b in zip(got, want)) <= atol, (got, want)
    assert sum(n > CLIP for n in want) >= len(want) // 2, f"clipping was not active: norms {want}"


@pytest.mark.slow
@pytest.mark.parametrize("program,args,nproc", [
    ("pipeline_microbatch.py", MLP + ["--schedule", "1f1b", "--microbatches", "4"], 2),
    ("pipeline_microbatch.py", MLP + ["--schedule", "interleaved", "--microbatches", "2"], 2),
    ("pipeline_microbatch.py", MLP + ["--schedule", "zb", "--microbatches", "4", "--recompute"], 2),
    ("pipeline_microbatch.py", CNN + ["--schedule", "gpipe", "--microbatches", "2", "--recompute"], 2),
    ("pipeline_dp_joint.py", MLP + ["--dp", "2", "--microbatches", "2"], 4),
    ("tensor_parallel.py", MLP, 2),                     # dropout after column-parallel layers: sharded masks
    ("tensor_parallel.py", CNN + ["--hybrid"], 2),      # block 1's dropout on each rank's batch slice
    ("parallel_3d.py", VIT + ["--dp", "1", "--tp", "2", "--microbatches", "2"], 4),
    ("parallel_3d.py", MLP + ["--dp", "2", "--tp", "2", "--microbatches", "2"], 4),
])
def test_losses_and_norms_equal_the_baseline_with_dropout_and_clipping(tmp_path, baseline, program, args, nproc):
    run = launch(program, args, tmp_path, nproc=nproc)
    flags = [a for a in args if a not in ("--hybrid", "--recompute")]
    cut = next((i for i, a in enumerate(flags) if a in ("--schedule", "--dp")), len(flags))
    reference = baseline(flags[:cut])
    assert_same_losses(run, reference)
    assert_same_norms(run, reference)


@pytest.mark.parametrize("program,args,nproc", [
    ("pipeline_microbatch.py", MLP + ["--microbatches", "2", "--check"], 2),
    ("tensor_parallel.py", MLP + ["--check"], 2),
])
def test_check_passes_with_dropout_and_clipping(tmp_path, program, args, nproc):
    run = launch(program, args, tmp_path, nproc=nproc)
    assert run.returncode == 0 and "MISMATCH" not in run.stdout + run.stderr, run.stdout[-2000:] + run.stderr[-2000:]


def test_dropout_and_clipping_each_change_the_loss(tmp_path, baseline):
    plain = [a for a in MLP if a not in REG]
    losses = {name: baseline(plain + extra).losses() for name, extra in
              [("plain", []), ("dropout", REG[:2]), ("clip", REG[2:])]}
    assert losses["dropout"][0] != losses["plain"][0]                   # masks from the first step on
    assert losses["clip"][0] == losses["plain"][0] != losses["clip"][-1]   # clipping acts from the update on


def test_keyed_masks_are_the_same_on_every_layout_of_one_tensor():
    """The masks of a [6, 4, 12] activation drawn whole, by sample slices (microbatches, replicas),
    by feature shards of 5, 4 and 3 (uneven tensor-parallel slices) and by token shards are the same bits."""
    keys, x = DropoutKeys(seed=3), torch.ones(6, 4, 12)
    whole = KeyedDropout(0.5, layer=7, keys=keys)
    with keys.training(step=11):
        full = whole(x)
    for first, n in [(0, 2), (2, 2), (4, 2), (1, 5)]:
        with keys.training(step=11, first_sample=first):
            assert torch.equal(whole(x[first:first + n]), full[first:first + n])
    for start, width in [(0, 5), (5, 4), (9, 3)]:
        shard = KeyedDropout(0.5, layer=7, keys=keys)
        shard.shard = (start, 12)
        with keys.training(step=11):
            assert torch.equal(shard(x[..., start:start + width]), full[..., start:start + width])
    for first, n in [(0, 2), (2, 1), (3, 1)]:   # token shards (sequence parallelism): dimension 1 split
        shard = KeyedDropout(0.5, layer=7, keys=keys)
        shard.first_token = first
        with keys.training(step=11):
            assert torch.equal(shard(x[:, first:first + n]), full[:, first:first + n])
    assert 0.4 < (full == 0).float().mean() < 0.6
    with keys.training(step=12):
        assert not torch.equal(whole(x), full)                  # another step, other masks
    assert torch.equal(whole(x), x)                             # not training (evaluation): no dropout


def test_the_hash_differs_in_every_coordinate():
    s, e = torch.arange(64), torch.arange(64)
    base = keep_mask(0, 0, 0, s, e, 0.5)
    for seed, step, layer in [(1, 0, 0), (0, 1, 0), (0, 0, 1)]:
        assert (keep_mask(seed, step, layer, s, e, 0.5) != base).float().mean() > 0.4
    assert (keep_mask(0, 0, 0, s + 64, e, 0.5) != base).float().mean() > 0.4


def test_clip_global_in_one_process_is_torchs_clip_grad_norm():
    args = parse_args(["--model", "mlp", "--hidden", "16", "--layers", "3"])
    a, b = build_model(args), build_model(args)
    x = torch.randn(4, 3, 32, 32)
    for model in (a, b):
        model(x).square().sum().backward()
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5).item()
    assert float(clip_global(a.parameters(), 0.5)) == pytest.approx(want, rel=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


@pytest.mark.parametrize("flags,message", [
    (["--dropout", "1"], "error: --dropout 1.0 must be a probability in [0, 1)"),
    (["--clip-grad-norm", "0"], "error: --clip-grad-norm 0.0 must be a finite number > 0"),
])
def test_bad_values_give_one_error_line(flags, message, monkeypatch, capsys):
    assert_one_error_line(parse_args, flags, 1, message, monkeypatch, capsys)
