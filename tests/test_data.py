"""The data path a user takes: --data cifar10 through torchvision's CIFAR10, downloaded once from a
loopback mirror of a fabricated archive; --data auto falling back offline; a corrupt archive."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

import cifar_mirror as cm
from mp.dist import Env
from mp.data import Cifar10Data, SyntheticData, agree_on_data
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
    run = torchrun("tensor_parallel.py", ARGS + ["--data-dir", data_dir, "--log-file", "tp.jsonl"], tmp_path, 2)
    assert run.returncode == 0, run.stderr[-3000:]
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "SYNTHETIC" in notes[0] and "could not download" in notes[0], run.stdout
    assert read_log(str(tmp_path / "tp.jsonl"))[0]["args"]["data"] == "synthetic"
    strict = launch("single_baseline.py", ARGS + ["--data", "cifar10", "--data-dir", data_dir], tmp_path)
    assert strict.returncode == 2
    lines = strict.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: CIFAR-10 is not in --data-dir"), strict.stderr


@pytest.mark.slow
def test_run_tp_with_no_knobs_runs_offline_and_plots(offline, tmp_path):
    """The defaults (300 steps of the cnn: about 40 s on two shared cores, hardly more than 20 steps,
    as start-up dominates); only where outputs go is set, and --data-dir keeps the test out of the
    repository's data/ (the launcher runs in its own folder)."""
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


def ranks_disagree(rank, world, group):
    args = argparse.Namespace(data="auto", seed=0, data_dir="data", timeout_s=60.0)
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    found = FoundCifar() if rank != 1 else SyntheticData(0, note="no network")
    data = agree_on_data(found, args, env)
    assert data.name == "synthetic" and args.data == "synthetic", (rank, data.name)


def test_when_one_rank_has_no_cifar10_every_rank_uses_synthetic(tmp_path):
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
