"""The gpt's foundation: the causal model, the text, the loss over the global batch's valid tokens, the
tiny Shakespeare download (from a mirror on 127.0.0.1), and the baseline that trains it."""
import argparse
import hashlib
import math
import os
import subprocess

import pytest
import torch

import cifar_mirror as cm
from helpers import PYTHON, ROOT, assert_one_error_line, launch
from mp import flags
from mp.cli import baseline_args, pipeline_args
from mp.loss import loss_function, token_sum, valid_tokens
from mp.models import build_model
from mp.text import IGNORE, TextData, synthetic_text

GPT = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16"]


def gpt_args(*extra, **kw):
    args = baseline_args(GPT + list(extra), "")
    return args if not kw else argparse.Namespace(**{**vars(args), **kw})


def test_the_model_is_causal_and_its_tied_weight_is_one_parameter():
    model = build_model(gpt_args("--tie-embeddings"))
    x = torch.randint(256, (2, 16))
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % 256                        # token 9 changed: positions 0-8 must not see it
    a, b = model(x), model(y)
    assert a.shape == (2, 16, 256)
    assert torch.equal(a[:, :9], b[:, :9]) and not torch.allclose(a[:, 9:], b[:, 9:])
    names = [n for n, _ in model.named_parameters()]
    assert "0.tok.weight" in names and "3.weight" not in names          # one parameter, the baseline's name
    assert model[3].weight is model[0].tok.weight
    untied = build_model(gpt_args())
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in model.parameters()) == 256 * 32
    for p, q in zip(model.parameters(), build_model(gpt_args("--tie-embeddings")).parameters()):
        assert torch.equal(p, q)                                            # from --seed, bit for bit


def test_the_tied_gradient_is_the_sum_of_both_uses():
    model = build_model(gpt_args("--tie-embeddings"))
    x = torch.randint(256, (2, 16))
    token_sum(model(x), x).backward()
    both = model[0].tok.weight.grad.clone()
    # the same model with the head's use of the weight cut off from the embedding's: the two parts add up
    head_only = model[3].weight.detach().clone().requires_grad_()
    model.zero_grad()
    h = x
    for block in list(model)[:3]:
        h = block(h)
    token_sum(model[3].ln(h) @ head_only.T, x).backward()
    torch.testing.assert_close(model[0].tok.weight.grad + head_only.grad, both)


def test_batches_masks_and_cuts_agree_however_they_are_drawn():
    data = TextData(synthetic_text(0, 20_000), "synthetic", seed=3, seq_len=16, mask_max=8)
    x, y = data.batch(5, 12)
    assert x.shape == y.shape == (12, 16) and x.dtype == torch.int64
    again = TextData(synthetic_text(0, 20_000), "synthetic", seed=3, seq_len=16, mask_max=8)
    assert torch.equal(again.batch(5, 12)[0], x) and torch.equal(again.labels(5, 12), y)
    assert torch.equal(torch.cat(list(data.image_parts(5, 12, 4))), x)
    assert torch.equal(data.images(5, 12, 3, 6), x[3:9])
    assert torch.equal(x[:, 1:][y[:, :-1] != IGNORE], y[:, :-1][y[:, :-1] != IGNORE])   # targets: the next bytes
    hidden = (y == IGNORE).sum(1)
    assert hidden.max() <= 8 and len(set(hidden.tolist())) > 3          # prefixes of 0-8, drawn per sample
    assert all(((y[i] == IGNORE).nonzero().flatten() == torch.arange(h)).all() for i, h in enumerate(hidden))
    assert not torch.equal(data.batch(6, 12)[0], x)
    tx, ty = data.test_set
    assert (ty != IGNORE).all() and torch.equal(tx[:, 1:], ty[:, :-1]) and len(tx) == (len(data.held_out) - 1) // 16
    assert not torch.equal(TextData(synthetic_text(1, 20_000), "synthetic", 3, 16, 8).batch(5, 12)[0], x)


def test_the_token_sum_is_float64_and_does_not_depend_on_how_the_batch_is_cut():
    """mp.loss.sum_in_float64: the loss a layout logs is its pieces' sums added, in its order; in float32 those
    differed from one batch's sum by up to 4 ulps of the loss with the same weights (1.9e-6, over the issue's 1e-6).
    In float64 the float32 terms add exactly: any cut, any order, the same sum to 1e-12."""
    logits = 3 * torch.randn(16, 64, 256, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(256, (16, 64), generator=torch.Generator().manual_seed(2))
    targets[:, :5] = IGNORE
    whole = token_sum(logits, targets)
    assert whole.dtype == torch.float64
    for cut in (1, 3, 8):
        pieces = [token_sum(lg, t) for lg, t in zip(logits.split(cut), targets.split(cut))]
        for order in (pieces, pieces[::-1]):
            assert abs(sum(order) - whole) <= 1e-12 * whole, (cut, float(sum(order) - whole))


def test_every_piece_scales_by_the_global_count_and_a_per_piece_mean_would_not():
    """The normalisation: the global batch cut into 4 pieces (2 microbatches x 2 replicas) whose valid
    counts differ; averaging the pieces' losses gives the baseline's sum / N, a per-piece mean does not."""
    args = gpt_args("--loss-mask", "prefix:12", "--batch-size", "8")
    data = TextData(synthetic_text(0, 20_000), "synthetic", args.seed, 16, 12)
    x, y = data.batch(0, 8)
    logits = 3 * torch.randn(8, 16, 256, generator=torch.Generator().manual_seed(0))   # a model's scale: far apart
    whole = loss_function(args, data, 0)(logits, y)
    torch.testing.assert_close(whole, token_sum(logits, y) / valid_tokens(y))
    piece = loss_function(args, data, 0, pieces=4)
    parts = list(zip(logits.split(2), y.split(2)))
    counts = [valid_tokens(t) for _, t in parts]
    assert len(set(counts)) > 1, counts
    torch.testing.assert_close(sum(piece(lg, t) for lg, t in parts) / 4, whole, rtol=1e-6, atol=0)
    per_piece = sum(token_sum(lg, t) / valid_tokens(t) for lg, t in parts) / 4
    assert abs(per_piece - whole) > 1e-3, "this batch must tell the two apart"


def test_the_baseline_learns_the_synthetic_text_and_reports_bits_per_byte(tmp_path):
    args = GPT + ["--data", "synthetic", "--steps", "40", "--eval-every", "40", "--optimizer", "adamw",
                  "--loss-mask", "prefix", "--dropout", "0.1", "--clip-grad-norm", "1"]
    run = launch("single_baseline.py", args, tmp_path)
    assert run.returncode == 0, run.stderr
    losses = run.losses()
    assert abs(losses[0] - math.log(256)) < 0.1, losses[0]             # uniform over the bytes at first
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses[-5:]
    ev, = run.events("eval")
    assert ev["test_bits_per_byte"] == pytest.approx(ev["test_loss"] / math.log(2))
    assert 10 / 256 < ev["test_acc"] < 1 and "bits per byte" in run.stdout          # 10x chance, at 40 steps


@pytest.mark.parametrize("argv, message", [
    (GPT + ["--seq-len", "0"], "error: --seq-len 0 must be a positive"),
    (GPT + ["--loss-mask", "prefix:16"], "error: --loss-mask prefix:16 could leave out all 16 tokens"),
    (GPT + ["--loss-mask", "suffix"], "error: --loss-mask suffix: use none, prefix"),
    (GPT + ["--data", "cifar10"], "error: --data cifar10 holds images and --model gpt reads text"),
    (["--model", "vit", "--data", "shakespeare"], "error: --data shakespeare is text, for --model gpt"),
    (["--model", "vit", "--seq-len", "32"], "error: --model vit does not use --seq-len"),
    (GPT + ["--text-file", "x.txt", "--data", "synthetic"], "error: --text-file x.txt is the data"),
])
def test_bad_gpt_flags_are_one_error_line(argv, message, monkeypatch, capsys):
    assert_one_error_line(lambda a: baseline_args(a, ""), argv, 1, message, monkeypatch, capsys)


def test_a_program_without_the_gpt_says_so(monkeypatch, capsys):
    """A program that has not learned the gpt (mp.flags.GPT_PROGRAMS) refuses it in one line."""
    monkeypatch.setattr(flags, "GPT_PROGRAMS", ("single_baseline",))
    assert_one_error_line(lambda a: pipeline_args(a, ""), GPT, 4,
                          "error: --model gpt: pipeline_microbatch.py does not train", monkeypatch, capsys)


def test_a_text_shorter_than_one_batch_or_missing_is_one_error_line(tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"to be or not to be " * 20)
    run = launch("single_baseline.py", GPT + ["--text-file", str(short), "--eval-every", "0"], tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "holds 380 bytes, fewer than one batch needs" in lines[0]
    run = launch("single_baseline.py", GPT + ["--text-file", str(tmp_path / "none.txt")], tmp_path)
    assert run.returncode == 2 and "no such file" in run.stderr


@pytest.fixture
def shakespeare(monkeypatch):
    """A stand-in for tiny Shakespeare on 127.0.0.1, named by MP_TEXT_MIRROR in every child process."""
    body = b"First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 800
    server = cm.Mirror(body)             # CIFAR-10's loopback mirror serves any bytes
    monkeypatch.setenv("MP_TEXT_MIRROR", f"{server.url} {hashlib.sha256(body).hexdigest()}")
    yield server
    server.close()


def test_two_ranks_download_the_text_once_and_train_on_it(shakespeare, tmp_path):
    data_dir = tmp_path / "data"
    args = GPT + ["--steps", "2", "--eval-every", "2", "--data-dir", str(data_dir), "--threads", "1"]
    run = launch("single_baseline.py", args, tmp_path)
    assert run.returncode == 0, run.stderr
    assert shakespeare.requests == 1 and run.stdout.count("downloading tiny Shakespeare") == 1
    assert run.events("config")[0]["args"]["data"] == "shakespeare" and "note:" not in run.stdout
    assert sorted(os.listdir(data_dir)) == [".text.lock", "tinyshakespeare.txt"]
    again = launch("single_baseline.py", args, tmp_path)
    assert again.returncode == 0 and shakespeare.requests == 1 and again.losses() == run.losses()
    (data_dir / "tinyshakespeare.txt").write_bytes(b"my own notes")                 # the user's file: kept
    wrong = launch("single_baseline.py", args, tmp_path)
    assert wrong.returncode == 2 and "is not tiny Shakespeare" in wrong.stderr
    assert (data_dir / "tinyshakespeare.txt").read_bytes() == b"my own notes"


def test_offline_auto_falls_back_to_the_synthetic_text_with_one_note(shakespeare, tmp_path, monkeypatch):
    monkeypatch.setenv("MP_TEXT_MIRROR", f"{shakespeare.url} {'0' * 64}")      # served, but not the text
    args = GPT + ["--steps", "1", "--eval-every", "0", "--data-dir", str(tmp_path / "data")]
    run = launch("single_baseline.py", args, tmp_path)
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "SYNTHETIC" in notes[0] and "not tiny Shakespeare" in notes[0], run.stdout
    strict = launch("single_baseline.py", GPT + ["--data", "shakespeare", "--data-dir", str(tmp_path / "data")],
                    tmp_path)
    assert strict.returncode == 2 and "error: tiny Shakespeare is not in --data-dir" in strict.stderr


def test_a_gpt_checkpoint_resumes_only_into_the_same_text_model(tmp_path):
    args = GPT + ["--data", "synthetic", "--steps", "2", "--eval-every", "0", "--checkpoint-dir", str(tmp_path / "ck"),
                  "--tie-embeddings"]
    assert launch("single_baseline.py", args, tmp_path).returncode == 0
    other = launch("single_baseline.py", args[:-1] + ["--steps", "3"], tmp_path)   # untied: another model
    assert other.returncode == 2 and "--tie-embeddings True there, False here" in other.stderr, other.stderr
    longer = launch("single_baseline.py", args + ["--steps", "3", "--seq-len", "32"], tmp_path)
    assert longer.returncode == 2 and "--seq-len 16 there, 32 here" in longer.stderr, longer.stderr


def test_the_sampler_writes_from_a_checkpoint_of_any_layout_and_refuses_others(tmp_path):
    ck = tmp_path / "ck"
    args = GPT + ["--data", "synthetic", "--steps", "2", "--eval-every", "0", "--checkpoint-dir", str(ck)]
    assert launch("single_baseline.py", args, tmp_path).returncode == 0

    def sample(*flags):
        return subprocess.run([PYTHON, "-m", "mp.tools.sample", *flags], cwd=ROOT, capture_output=True,   # forked
                              text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))  # (tests/python)
    a, b = (sample("--checkpoint-dir", str(ck), "--prompt", "Once", "--bytes", "40") for _ in range(2))
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and "after 2 steps" in a.stdout and "\nOnce" in a.stdout        # seeded draws
    assert len(a.stdout.split("\nOnce", 1)[1].encode(errors="replace")) >= 40
    none = sample("--checkpoint-dir", str(tmp_path / "none"))
    assert none.returncode == 2 and none.stderr.startswith("error: --checkpoint-dir") and none.stderr.count("\n") == 1
