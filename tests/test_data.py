"""The data path a user takes: --data cifar10 through torchvision's CIFAR10, downloaded once from a
loopback mirror of a fabricated archive; --data auto falling back offline; a corrupt archive."""
import argparse
import itertools
import os
import subprocess
import sys

import pytest
import torch

import cifar_mirror as cm
from mp.dist import Env
from mp.data import Cifar10Data, SyntheticData, agree_on_data, dp_slice, next_batch
from mp.text import TextData, synthetic_data
from helpers import PYTHON, ROOT, launch, read_log, run_ranks

ARGS = ["--model", "mlp", "--layers", "4", "--hidden", "32", "--steps", "4", "--batch-size", "16",
        "--threads", "1"]


@pytest.fixture(scope="module")
def fake():
    return cm.make_archive()


@pytest.fixture
def mirror(fake, tmp_path, monkeypatch):
    archive, md5s = fake
    server = cm.Mirror(archive)
    cm.mirror_env(monkeypatch, cm.write_spec(tmp_path / "spec.json", server.url, archive, md5s))
    yield server
    server.close()


def torchrun(program, args, tmp_path, nproc):
    """As a user types it: torchrun, the script, its flags (no `--`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, program), *args]
    return subprocess.run(cmd, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_four_ranks_download_once_train_evaluate_and_match_the_baseline(mirror, tmp_path, fake):
    data_dir = str(tmp_path / "data")
    args = ARGS + ["--data", "cifar10", "--data-dir", data_dir, "--eval-every", "2"]
    run = torchrun("pipeline_microbatch.py", args + ["--log-file", "pipe.jsonl"], tmp_path, nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    assert mirror.requests == 1                                   # one download for 4 ranks, train and test
    assert run.stdout.count("downloading CIFAR-10") == 1 and "%|" not in run.stdout + run.stderr  # no tqdm bars
    records = read_log(str(tmp_path / "pipe.jsonl"))
    assert records[0]["args"]["data"] == "cifar10"
    assert len([r for r in records if r["event"] == "eval"]) == 2
    reference = launch("single_baseline.py", args, tmp_path)      # the same files: no second download
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert mirror.requests == 1
    got = [r["loss"] for r in records if r["event"] == "train"]
    assert len(got) == len(reference.losses()) == 4
    assert max(abs(a - b) for a, b in zip(got, reference.losses())) <= 1e-4
    assert sorted(os.listdir(data_dir)) == [".cifar10.lock", cm.FOLDER, cm.ARCHIVE]  # no temp files left


def test_a_truncated_archive_is_one_error_and_stays_where_it_was(mirror, tmp_path, fake):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / cm.ARCHIVE).write_bytes(fake[0][: len(fake[0]) // 2])
    run = launch("single_baseline.py", ARGS + ["--data", "cifar10", "--data-dir", str(data_dir)], tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "truncated or corrupt" in lines[0], run.stderr
    assert (data_dir / cm.ARCHIVE).stat().st_size == len(fake[0]) // 2    # the user's file, untouched
    assert mirror.requests == 0 and not (data_dir / cm.FOLDER).exists()


@pytest.fixture
def offline(fake, tmp_path, monkeypatch):
    archive, md5s = fake
    cm.mirror_env(monkeypatch, cm.write_spec(tmp_path / "spec.json", cm.closed_port_url(), archive, md5s))


def test_offline_auto_falls_back_to_synthetic_with_one_note_and_cifar10_fails(offline, tmp_path):
    data_dir = str(tmp_path / "data")
    run = launch("tensor_parallel.py", ARGS + ["--data-dir", data_dir], tmp_path, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]   # ranks forked from the tests' zygote (as a user types it: slow)
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "SYNTHETIC" in notes[0] and "could not download" in notes[0], run.stdout
    assert run.records[0]["args"]["data"] == "synthetic"
    strict = launch("single_baseline.py", ARGS + ["--data", "cifar10", "--data-dir", data_dir], tmp_path)
    assert strict.returncode == 2
    lines = strict.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: CIFAR-10 is not in --data-dir"), strict.stderr


@pytest.mark.slow
def test_run_tp_with_no_knobs_runs_offline_and_plots(offline, tmp_path):
    """The defaults (300 steps of the cnn, baseline and tensor-parallel run, and the plot: 45 s alone
    and 68 s in the suite on the slow 2-core machine of 2026-11-26, the suite's longest test outside
    Slurm); only where outputs go is set, and --data-dir keeps the test out of the repository's data/
    (the launcher runs in its own folder)."""
    env = dict(os.environ, PYTHON=PYTHON, LOGS=str(tmp_path / "logs"), PLOTS=str(tmp_path / "plots"),
               OMP_NUM_THREADS="1")
    for knob in ("DATA", "STEPS", "MODEL", "NPROC", "EVAL_EVERY", "BATCH_SIZE"):
        env.pop(knob, None)
    run = subprocess.run(["bash", os.path.join(ROOT, "run_tp.sh"), "--data-dir", str(tmp_path / "data")], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "note: --data auto uses the SYNTHETIC data" in run.stdout
    assert (tmp_path / "plots" / "tp_loss.png").stat().st_size > 10_000


@pytest.mark.slow
def test_two_jobs_on_one_empty_data_dir_download_once(mirror, tmp_path):
    data_dir = str(tmp_path / "data")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "single_baseline.py"), *ARGS, "--data", "cifar10",
                              "--data-dir", data_dir, "--eval-every", "0", "--log-file", f"job{i}.jsonl"],
                             cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
    outputs = [job.communicate(timeout=300) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert mirror.requests == 1
    first, second = (read_log(str(tmp_path / f"job{i}.jsonl")) for i in range(2))
    assert [r["loss"] for r in first if r["event"] == "train"] == [r["loss"] for r in second if r["event"] == "train"]


class FoundCifar:
    """Stands in for a Cifar10Data on the ranks that found the files."""
    name, note = "cifar10", None


class FoundText:
    """Stands in for tiny Shakespeare (mp.text.TextData) on the ranks that found it."""
    name, note = "shakespeare", None


def ranks_disagree(rank, world, group):
    args = argparse.Namespace(data="auto", seed=0, data_dir="data", timeout_s=60.0, model="cnn")
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    found = FoundCifar() if rank != 1 else SyntheticData(0, note="no network")
    data = agree_on_data(found, args, env)
    assert data.name == "synthetic" and args.data == "synthetic" and isinstance(data, SyntheticData), (rank, data)
    # the gpt's text alike: the ranks that found tiny Shakespeare take the synthetic text too
    args = argparse.Namespace(data="auto", seed=0, data_dir="data", timeout_s=60.0, model="gpt", seq_len=16,
                              mask_max=0, batch_size=8)
    found = FoundText() if rank != 1 else synthetic_data(args, note="no network")
    data = agree_on_data(found, args, env)
    assert data.name == "synthetic" and args.data == "synthetic" and isinstance(data, TextData), (rank, data)


def test_when_one_rank_has_no_cifar10_or_text_every_rank_uses_synthetic(tmp_path):
    run_ranks(ranks_disagree, 3, tmp_path)


def test_the_test_split_is_normalised_once():
    data = Cifar10Data.__new__(Cifar10Data)         # CIFAR-10 shaped, without the files
    data.test = torch.randint(256, (20, 3, 32, 32), dtype=torch.uint8), torch.randint(10, (20,))
    first = data.test_set
    assert data.test_set is first and torch.equal(first[0], Cifar10Data.normalise(data.test[0]))


def test_synthetic_batches_agree_however_they_are_drawn():
    """labels() and image_parts() are batch() without the images, or in microbatches: every rank
    that draws a step gets the same numbers, whatever it needs of them."""
    data = SyntheticData(5)
    x, y = data.batch(11, 24)
    assert torch.equal(data.labels(11, 24), y)
    assert torch.equal(torch.cat(list(data.image_parts(11, 24, 4))), x)
    assert torch.equal(SyntheticData(5).batch(11, 24)[0], x) and not torch.equal(data.batch(12, 24)[0], x)
    assert x.shape == (24, 3, 32, 32) and 0.9 < x.std() < 1.2     # noise of std 1 under the class pattern
    # the class is in the image: the mean pattern of a class's samples points along its prototype
    xs, ys = data.test_set
    for c in range(3):
        mean = xs[ys == c].mean(0).flatten()
        cosines = torch.nn.functional.cosine_similarity(mean[None], data.prototypes.flatten(1))
        assert cosines.argmax() == c and cosines[c] > 0.5, cosines


# ----------------------------------------------------------------------------- one batch, any cut


def Replica(dp_rank, dp_size):
    """Replica dp_rank of dp_size, as pipeline_dp_joint.py hands it to next_batch."""
    return dp_rank, dp_size


def fake_cifar(n=100, seed=5):
    """A Cifar10Data with n random CIFAR-shaped training samples, without the files."""
    data = Cifar10Data.__new__(Cifar10Data)
    data.train = torch.randint(256, (n, 3, 32, 32), dtype=torch.uint8), torch.randint(10, (n,))
    data.seed = seed
    return data


def first_stage_inputs(data, step, batch_size, m, replica, stream):
    """What a first (and last) stage of `replica` trains on at `step`: its images, whole, and its labels."""
    args = argparse.Namespace(batch_size=batch_size, microbatches=m)
    pos = argparse.Namespace(is_first_stage=True, is_last_stage=True)
    x, y = next_batch(data, step, args, pos, torch.device("cpu"), replica, stream=stream)
    return (torch.cat([x[mb] for mb in range(m)]) if stream else x), y


BATCH = 24
CUTS = [(d, m) for d in range(1, BATCH + 1) for m in range(1, BATCH + 1) if BATCH % (d * m) == 0]


@pytest.mark.parametrize("kind", ["synthetic", "cifar"])
def test_every_cut_of_a_batch_gives_its_samples(kind):
    """Every (D replicas, m microbatches) that divides the batch, streamed or whole: replica d's
    images and labels are dp_slice's of batch(), bit for bit (step 5 is in CIFAR's second epoch)."""
    data = SyntheticData(5) if kind == "synthetic" else fake_cifar()
    assert len(CUTS) == 30
    for step in (0, 5):
        x, y = data.batch(step, BATCH)
        for (dp, m), stream in itertools.product(CUTS, (True, False)):
            for d in range(dp):
                got_x, got_y = first_stage_inputs(data, step, BATCH, m, Replica(d, dp), stream)
                want = (dp_slice(x, d, dp), dp_slice(y, d, dp))
                assert torch.equal(got_x, want[0]) and torch.equal(got_y, want[1]), (kind, step, dp, m, d, stream)
        assert torch.equal(data.images(step, BATCH, 7, 5), x[7:12])     # any run of samples, not only parts


def test_the_permutation_is_drawn_once_per_epoch_and_orders_as_before(monkeypatch):
    """One randperm per epoch, however many times and ways its steps are drawn; the batches are the
    slices of torch.randperm(N, seed + epoch), as before the cache."""
    data, calls = fake_cifar(), []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a) or randperm(*a, **k))
    per_epoch = 100 // 16
    for step in range(2 * per_epoch):
        epoch, i = divmod(step, per_epoch)
        order = randperm(100, generator=torch.Generator().manual_seed(5 + epoch))[i * 16:(i + 1) * 16]
        x, y = data.batch(step, 16)
        assert torch.equal(x, Cifar10Data.normalise(data.train[0][order])) and torch.equal(y, data.train[1][order])
        assert torch.equal(data.labels(step, 16), y) and torch.equal(torch.cat(list(data.image_parts(step, 16, 4))), x)
        assert torch.equal(data.images(step, 16, 3, 9), x[3:12])
        assert len(calls) == epoch + 1, (step, calls)
    data.batch(0, 16)                               # back to epoch 0 (a new run in the same process): drawn again
    assert len(calls) == 3 and all(a == (100,) for a in calls)


def count_noise(monkeypatch):
    """The number of noise values drawn from here on (torch.randn and Tensor.normal_)."""
    drawn = [0]
    randn, normal_ = torch.randn, torch.Tensor.normal_

    def counting_randn(*size, **kw):
        out = randn(*size, **kw)
        drawn[0] += out.numel()
        return out

    def counting_normal_(self, *a, **kw):
        drawn[0] += self.numel()
        return normal_(self, *a, **kw)
    monkeypatch.setattr(torch, "randn", counting_randn)
    monkeypatch.setattr(torch.Tensor, "normal_", counting_normal_)
    return drawn


@pytest.mark.parametrize("stream", [True, False])
def test_a_replica_draws_only_its_own_samples(monkeypatch, stream):
    """Replica d of 3 generates the noise of its 8 samples of 24, and a stream one microbatch (4)
    at a time; on CIFAR-10 it gathers and normalises its 8 samples alone."""
    synthetic, cifar = SyntheticData(5), fake_cifar()
    drawn = count_noise(monkeypatch)
    normalised = []
    normalise = Cifar10Data.normalise
    monkeypatch.setattr(Cifar10Data, "normalise", staticmethod(lambda x: normalised.append(len(x)) or normalise(x)))
    per_sample = 3 * 32 * 32
    for d in range(3):
        drawn[0] = 0
        first_stage_inputs(synthetic, 2, BATCH, 2, Replica(d, 3), stream)
        assert drawn[0] == 8 * per_sample, (d, drawn[0] / per_sample)
        normalised.clear()
        first_stage_inputs(cifar, 2, BATCH, 2, Replica(d, 3), stream)
        assert sum(normalised) == 8, (d, normalised)
    if stream:                                      # and each microbatch only when its forward reads it
        drawn[0] = 0
        x, _ = next_batch(synthetic, 2, argparse.Namespace(batch_size=BATCH, microbatches=2),
                          argparse.Namespace(is_first_stage=True, is_last_stage=False), torch.device("cpu"),
                          Replica(2, 3), stream=True)
        assert drawn[0] == 0
        x[0]
        assert drawn[0] == 4 * per_sample


def test_the_synthetic_labels_and_contrasts_are_those_drawn_before_per_sample_noise():
    """Only the noise changed when each sample got its own generator (issue 35): a step's labels and
    contrasts are still the first draws of the generator seeded with seed * 1_000_003 + step, so
    what is left of an image without its class pattern is noise, with none of the pattern in it."""
    data = SyntheticData(5)
    g = torch.Generator().manual_seed(5 * 1_000_003 + 11)
    labels = torch.randint(10, (24,), generator=g)
    contrast = SyntheticData.CONTRAST * torch.rand(24, 1, 1, 1, generator=g)
    x, y = data.batch(11, 24)
    assert torch.equal(y, labels) and torch.equal(data.labels(11, 24), labels)
    pattern = data.prototypes[y]
    noise = x - contrast * pattern
    left = (noise * pattern).flatten(1).sum(1) / (pattern * pattern).flatten(1).sum(1)   # the pattern's share
    assert left.abs().max() < 0.15 and 0.9 < noise.std() < 1.1, (left, noise.std())
