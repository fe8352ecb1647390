"""The reference program: it trains, follows the log contract, and refuses bad input clearly."""
import os

import pytest

from helpers import FAST, launch, read_log
from mp.log import newest_log


def test_baseline_trains_and_follows_the_log_contract(tmp_path):
    run = launch("single_baseline.py", ["--data", "synthetic", "--steps", "300", "--eval-every", "150"], tmp_path)
    assert run.returncode == 0, run.stderr
    config, = run.events("config")
    assert config["program"] == "single_baseline" and config["world_size"] == 1
    assert config["args"]["batch_size"] == 64 and config["backend"] == "gloo"
    train = run.events("train")
    assert [r["step"] for r in train] == list(range(300))
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 for r in train)
    losses = run.losses()
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5, "the loss must clearly fall"
    assert sum(losses[90:100]) / 10 < 2.0, "within the README's 100-step example"   # 2.22 before issue 28
    evals = run.events("eval")
    assert [r["step"] for r in evals] == [149, 299]
    assert 0.6 < evals[-1]["test_acc"] < 0.95, "far above the 10% of chance, and not a trivial task"
    summary, = run.events("summary")
    assert summary["steps"] == 300 and summary["median_step_time_s"] > 0
    assert list(summary["peak_memory_mb"]) == ["0"]


def test_two_runs_log_identical_losses(tmp_path):
    a = launch("single_baseline.py", FAST + ["--steps", "5"], tmp_path, log_name="a.jsonl")
    b = launch("single_baseline.py", FAST + ["--steps", "5"], tmp_path, log_name="b.jsonl")
    assert a.losses() == b.losses() and len(a.losses()) == 5


BAD = [
    (["--steps", "-3"], "--steps -3 must be a positive integer"),
    (["--lr", "nan"], "--lr nan must be a finite number"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--model", "resnet"], "invalid choice: 'resnet'"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_gives_one_error_line_and_exit_2(tmp_path, argv, message):
    run = launch("single_baseline.py", ["--data", "synthetic"] + argv, tmp_path)
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and message in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


@pytest.mark.slow   # a real python (about 6 s)
def test_cifar10_without_torchvision_or_network_is_a_clear_error(tmp_path, monkeypatch):
    """torchvision hidden by one that fails to import (a fresh python: the tests' zygote has imported
    the real one), so this runs whether or not torchvision is installed, and never downloads."""
    broken = tmp_path / "hide" / "torchvision"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(broken.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = launch("single_baseline.py", ["--data", "cifar10", "--data-dir", str(tmp_path / "none")], tmp_path,
                 real=True)
    assert run.returncode == 2
    assert run.stderr.startswith("error: CIFAR-10 is not in --data-dir"), run.stderr
    assert "torchvision failed to import" in run.stderr
    assert "--data synthetic" in run.stderr and run.stderr.count("\n") == 1


def test_a_diverging_loss_stops_training_naming_the_step(tmp_path):
    run = launch("single_baseline.py", FAST + ["--lr", "1000", "--steps", "50"], tmp_path)
    assert run.returncode == 2
    assert run.stderr.startswith("error: the loss became nan at step 3"), run.stderr
    partial = newest_log(str(tmp_path / "single_baseline-1.jsonl"))   # a failed run's log says it is partial
    assert ".partial-" in partial and not os.path.exists(tmp_path / "single_baseline-1.jsonl")
    records = read_log(partial)    # the steps before it stay there, as valid JSON lines
    assert [r["step"] for r in records if r["event"] == "train"] == [0, 1, 2]
