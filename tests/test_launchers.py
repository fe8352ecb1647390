"""The run_*.sh launchers: a short run plots; a failed step stops the script with its name and
nothing is plotted after it."""
import os
import subprocess
import sys

from helpers import ROOT


def launcher(script, tmp_path, args=(), **knobs):
    env = dict(os.environ, PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), DATA="synthetic", EVAL_EVERY="0",
               OMP_NUM_THREADS="1", **knobs)   # PLOTS left to its default, $LOGS/plots
    return subprocess.run(["bash", os.path.join(ROOT, script), *args], env=env, capture_output=True,
                          text=True, timeout=240)


def test_run_tp_plots_the_curves_and_prints_the_largest_difference(tmp_path):
    run = launcher("run_tp.sh", tmp_path, ["--hidden", "32", "--layers", "4"], MODEL="mlp", STEPS="4", NPROC="2")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "logs" / "plots" / "tp_loss.png").stat().st_size > 10_000   # not the committed plots/
    assert "largest |loss - baseline|" in run.stdout


def test_a_failed_parallel_step_stops_the_launcher_before_it_plots(tmp_path):
    # arguments that pass the early check, but nccl needs a GPU per rank: the joint step itself fails
    run = launcher("run_joint.sh", tmp_path, ["--hidden", "32", "--layers", "4"], MODEL="mlp", STEPS="2",
                   BACKEND="nccl", NPROC="6")
    assert run.returncode != 0
    assert "error: " in run.stderr                                  # the program's own one-line reason
    assert "run_joint.sh: stopped: this step failed with exit status" in run.stderr
    assert "pipeline_dp_joint.py" in run.stderr.splitlines()[-1]    # names the step that failed
    assert not (tmp_path / "logs" / "plots" / "joint_loss.png").exists()


def test_a_bad_argument_stops_the_launcher_before_anything_trains(tmp_path):
    run = launcher("run_pipeline.sh", tmp_path, ["--steps", "-3"], MODEL="mlp")
    assert run.returncode != 0
    assert run.stderr.startswith("error: --steps -3 must be a positive integer"), run.stderr
    assert "pipeline_microbatch" in run.stderr.splitlines()[-1] and "== baseline" not in run.stdout
    assert not os.path.exists(tmp_path / "logs" / "plots" / "pipeline_loss.png")


def test_the_parallel_arguments_are_checked_before_anything_trains(tmp_path):
    """--heads 4 cannot be split over 3 ranks: the launcher stops before the baseline trains."""
    run = launcher("run_tp.sh", tmp_path, MODEL="vit", NPROC="3", STEPS="2")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("error: --heads 4 is not divisible by the tensor-parallel degree 3")
    assert "== baseline" not in run.stdout and not list((tmp_path / "logs").glob("*.jsonl"))


def test_run_3d_plots_the_grid_against_the_baseline(tmp_path):
    run = launcher("run_3d.sh", tmp_path, ["--hidden", "32", "--layers", "4"], MODEL="mlp", STEPS="3", NPROC="4",
                   DP="1", TP="2", BATCH_SIZE="16")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "== 3-D: 1 replicas x 2 stages x 2 tp ranks" in run.stdout
    assert (tmp_path / "logs" / "plots" / "3d_loss.png").stat().st_size > 10_000
    assert "largest |loss - baseline| for parallel_3d (1f1b, dp=1, tp=2, m=4, 4 ranks, batch 16)" in run.stdout


def test_run_3d_checks_the_grid_before_anything_trains(tmp_path):
    run = launcher("run_3d.sh", tmp_path, MODEL="mlp", NPROC="6", STEPS="2")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("error: the world size 6 is not divisible by --dp 2 x --tp 2 = 4")
    assert "== baseline" not in run.stdout and not list((tmp_path / "logs").glob("*.jsonl"))
