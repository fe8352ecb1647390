"""--activation relu: the course's Sequential(linear1, relu, linear2) is `--model mlp --layers 2
--activation relu`, and every program reproduces the baseline's losses with it over a short run (a
long one drifts further than with gelu: docs/equivalence.md gives the measured drift and why).
Bad values fail as every flag does; the launchers take it as the ACTIVATION knob."""
import argparse
import os
import subprocess

import pytest
import torch.nn as nn

import pipeline_microbatch
from mp.tools import plot_curves
import tensor_parallel
from mp.models import build_model
from helpers import FAST, PYTHON, ROOT, assert_one_error_line, assert_same_losses, launch

COURSE = FAST + ["--model", "mlp", "--layers", "2", "--hidden", "64", "--activation", "relu", "--steps", "12"]
CNN = FAST + ["--activation", "relu", "--batch-size", "16", "--steps", "8"]


def test_the_mlp_of_two_layers_is_linear_relu_linear():
    args = argparse.Namespace(model="mlp", layers=2, hidden=64, heads=4, seed=0, dropout=0.0, activation="relu")
    layers = [m for block in build_model(args) for m in block if not isinstance(m, nn.Flatten)
              and m.__class__.__name__ != "KeyedDropout"]   # dropout with p=0 is the identity
    assert [type(m) for m in layers] == [nn.Linear, nn.ReLU, nn.Linear]
    assert (layers[0].in_features, layers[0].out_features, layers[2].out_features) == (3072, 64, 10)
    gelu = build_model(argparse.Namespace(**{**vars(args), "activation": "gelu"}))
    assert any(isinstance(m, nn.GELU) for block in gelu for m in block)   # the default stays gelu


@pytest.mark.parametrize("parse_args,world", [(tensor_parallel.parse_args, 2), (pipeline_microbatch.parse_args, 2)])
def test_a_bad_activation_is_one_error_line(parse_args, world, monkeypatch, capsys):
    assert_one_error_line(parse_args, ["--data", "synthetic", "--activation", "tanh"], world,
                          "error: argument --activation: invalid choice: 'tanh' (choose from 'gelu', 'relu')",
                          monkeypatch, capsys)


@pytest.mark.parametrize("model,nproc", [("course", 2), ("cnn", 2)])
def test_tensor_parallel_relu_logs_the_baseline_losses_and_check_matches(tmp_path, baseline, model, nproc):
    args = COURSE if model == "course" else CNN
    assert_same_losses(launch("tensor_parallel.py", args, tmp_path, nproc=nproc), baseline(args))
    check = launch("tensor_parallel.py", args + ["--check"], tmp_path, nproc=nproc, log_name="check.jsonl")
    assert check.returncode == 0 and "all tensors match the full model" in check.stdout, check.stdout + check.stderr[-2000:]


@pytest.mark.parametrize("args,stages,schedule", [(COURSE, 2, "zb"), (CNN, 4, "1f1b")])
def test_pipeline_relu_logs_the_baseline_losses(tmp_path, baseline, args, stages, schedule):
    run = launch("pipeline_microbatch.py", args + ["--schedule", schedule, "--microbatches", "4"], tmp_path,
                 nproc=stages)
    assert_same_losses(run, baseline(args))


@pytest.mark.slow
def test_joint_and_3d_relu_log_the_baseline_losses(tmp_path, baseline):
    mlp = FAST + ["--model", "mlp", "--layers", "4", "--hidden", "32", "--activation", "relu", "--batch-size", "16",
                  "--steps", "6"]
    assert_same_losses(launch("pipeline_dp_joint.py", mlp + ["--dp", "2", "--microbatches", "2"], tmp_path,
                              nproc=4), baseline(mlp))
    assert_same_losses(launch("parallel_3d.py", CNN + ["--dp", "1", "--tp", "2", "--microbatches", "2"], tmp_path,
                              nproc=4, log_name="3d.jsonl"), baseline(CNN))


def launcher(script, tmp_path, args=(), **knobs):
    env = dict(os.environ, PYTHON=PYTHON, LOGS=str(tmp_path / "logs"), DATA="synthetic", OMP_NUM_THREADS="1",
               **knobs)
    return subprocess.run(["bash", os.path.join(ROOT, script), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_launchers_take_the_activation_as_a_knob(tmp_path):
    run = launcher("run_tp.sh", tmp_path, ACTIVATION="tanh")
    assert run.returncode == 2 and run.stderr.splitlines() == ["error: ACTIVATION=tanh must be one of: gelu relu"]
    run = launcher("run_pipeline.sh", tmp_path, ["--activation", "relu"])
    assert run.returncode == 2 and "use ACTIVATION=relu bash run_pipeline.sh" in run.stderr, run.stderr
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").glob("*.jsonl"))


def test_a_relu_run_says_so_in_the_title_and_is_not_compared_with_a_gelu_one():
    def log(activation):
        args = {"model": "mlp", "data": "synthetic", "batch_size": 64, "steps": 2, "lr": 0.02, "seed": 0}
        if activation:
            args["activation"] = activation
        return [{"event": "config", "program": "p", "args": args, "world_size": 1},
                {"event": "train", "step": 0, "loss": 2.3}]
    relu = [("base", log("relu")), ("tp", log("relu"))]
    assert "model mlp (relu)," in plot_curves.title_of(relu, plot_curves.setting_differences(relu))
    assert plot_curves.setting_differences([("base", log(None)), ("tp", log("gelu"))]) == []   # an older log: gelu
    assert plot_curves.setting_differences([("base", log("gelu")), ("tp", log("relu"))]) == [
        "activation gelu (baseline) vs relu (tp)"]
