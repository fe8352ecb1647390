"""The run_*.sh launchers: a short run plots; a failed step stops the script with its name and
nothing is plotted after it."""
import os
import subprocess
import sys

from helpers import ROOT


def launcher(script, tmp_path, args=(), **knobs):
    env = dict(os.environ, PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), PLOTS=str(tmp_path / "plots"),
               DATA="synthetic", EVAL_EVERY="0", OMP_NUM_THREADS="1", **knobs)
    return subprocess.run(["bash", os.path.join(ROOT, script), *args], env=env, capture_output=True,
                          text=True, timeout=240)


def test_run_tp_plots_the_curves_and_prints_the_largest_difference(tmp_path):
    run = launcher("run_tp.sh", tmp_path, ["--hidden", "32", "--layers", "4"], MODEL="mlp", STEPS="4", NPROC="2")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "plots" / "tp_loss.png").stat().st_size > 10_000
    assert "largest |loss - baseline|" in run.stdout


def test_a_failed_parallel_step_stops_the_launcher_before_it_plots(tmp_path):
    run = launcher("run_joint.sh", tmp_path, ["--hidden", "32", "--layers", "4"], MODEL="mlp", STEPS="2",
                   DP="4", NPROC="6")
    assert run.returncode != 0
    assert "error: " in run.stderr                                  # the program's own one-line reason
    assert "run_joint.sh: stopped: this step failed with exit status" in run.stderr
    assert "pipeline_dp_joint.py" in run.stderr.splitlines()[-1]    # names the step that failed
    assert not (tmp_path / "plots" / "joint_loss.png").exists()


def test_a_bad_argument_stops_the_launcher_at_the_baseline(tmp_path):
    run = launcher("run_pipeline.sh", tmp_path, ["--steps", "-3"], MODEL="mlp")
    assert run.returncode != 0
    assert "error: " in run.stderr and "single_baseline.py" in run.stderr.splitlines()[-1]
    assert not os.path.exists(tmp_path / "plots" / "pipeline_loss.png")
