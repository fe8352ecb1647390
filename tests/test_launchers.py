"""The run_*.sh launchers: a short run plots; a failed step stops the script with its name and
nothing is plotted after it."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from mp.tools import plot_curves, plot_timeline
from helpers import PYTHON, ROOT, written


def launcher(script, tmp_path, args=(), cwd=None, **knobs):
    env = dict(os.environ, PYTHON=PYTHON, LOGS=str(tmp_path / "logs"), DATA="synthetic", EVAL_EVERY="0",
               OMP_NUM_THREADS="1")   # PLOTS left to its default, $LOGS/plots
    env.update(knobs)
    return subprocess.run(["bash", os.path.join(ROOT, script), *args], env=env, capture_output=True,
                          text=True, timeout=240, cwd=cwd)


def without_torch(tmp_path):
    """Knobs that run a launcher with the real python and a `torch` whose import fails, saying so: for the paths
    that must answer before torch is ever imported (refusals, CHECK_ONLY)."""
    fake = tmp_path / "no_torch" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('torch imported on a path that must not import it')\n")
    return {"PYTHON": sys.executable, "PYTHONPATH": str(fake.parent)}


def test_run_tp_plots_the_curves_and_prints_the_largest_difference(tmp_path):
    """Run from another directory, as `bash ~/mp/run_tp.sh`: a relative LOGS is the repository's
    folder, and every path printed is absolute, so it opens from where the user stands."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = launcher("run_tp.sh", tmp_path, ["--hidden", "32", "--layers", "4"], cwd=elsewhere, MODEL="mlp",
                   STEPS="4", NPROC="2", LOGS=os.path.relpath(tmp_path / "logs", ROOT))
    assert run.returncode == 0, run.stderr[-2000:]
    logs = tmp_path / "logs"      # not the committed plots/; every setting off its default in the names
    tag = "_mlp_hidden32_layers4_steps4_synthetic_evalevery0"
    assert all(os.path.isabs(path) for path in written(run.stdout)), run.stdout
    assert [os.path.realpath(path) for path in written(run.stdout)] == [
        os.path.realpath(path) for path in (f"{logs}/single_baseline{tag}_b64.jsonl",
                                            f"{logs}/tensor_parallel{tag}_tp2_b64.jsonl", f"{logs}/plots/tp_loss{tag}.png")]
    # issue 67, item 6: a program writes into the run's own folder until the launcher moves the set in
    # place; its line says where the file goes, never the folder that vanishes at the end
    assert ".unfinished" not in run.stdout, run.stdout
    # issue 85, item 2d: one line says so, not one line a file
    moved = re.findall(r"^finished: the runs' files move together to (\S+) \(figures: (\S+)\) when the launcher ends; "
                       r"its last lines name them$", run.stdout, re.M)
    assert [tuple(map(os.path.realpath, m)) for m in moved] == [(str(logs), str(logs / "plots"))], run.stdout
    assert run.stdout.count("when the launcher ends") == 1, run.stdout
    assert all(os.path.getsize(path) > 0 for path in written(run.stdout))
    assert (logs / "plots" / f"tp_loss{tag}.png").stat().st_size > 10_000
    # issue 67, item 1: the last line says what holds, after the files
    last = run.stdout.splitlines()[-1]
    assert last.startswith("largest |loss - baseline| for tensor_parallel (2 ranks, batch 64): ") and \
        last.endswith("over all 4 steps: the contract (1e-4) holds"), last


def failing_torchrun(tmp_path):
    """A PYTHON for the launchers whose torchrun fails as a rank would (one `error:` line, exit 1), and
    that is the tests' python for everything else: the parallel step fails after the checks passed."""
    path = tmp_path / "python-failing-torchrun"
    path.write_text("#!/bin/bash\nfor arg in \"$@\"; do\n  if [ \"$arg\" = mp.tools.torchrun ]; then\n"
                    "    echo 'error: rank 1 failed (a stand-in for a failing run)' >&2; exit 1\n  fi\ndone\n"
                    f"exec {PYTHON} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def test_a_failed_parallel_step_stops_the_launcher_before_it_plots(tmp_path):
    run = launcher("run_joint.sh", tmp_path, ["--hidden", "32", "--layers", "4"], MODEL="mlp", STEPS="2",
                   NPROC="6", PYTHON=failing_torchrun(tmp_path))
    assert run.returncode != 0
    assert "error: " in run.stderr                                  # the program's own one-line reason
    last = run.stderr.splitlines()[-1]                              # names the step that failed, expanded
    assert last.startswith("run_joint.sh: stopped: the joint run (pipeline_dp_joint.py on 6 ranks) failed "
                           "with exit status"), last
    assert "$" not in last and '"' not in last, last                 # no bash source such as "${COMMON[@]}"
    assert not list((tmp_path / "logs" / "plots").glob("*.png"))


def test_a_bad_knob_stops_the_launcher_before_anything_trains_in_the_knobs_terms(tmp_path):
    run = launcher("run_pipeline.sh", tmp_path, MODEL="mlp", STEPS="-3")
    assert run.returncode == 2
    assert run.stderr.splitlines() == ["error: STEPS=-3 must be a positive integer"], run.stderr
    assert "== baseline" not in run.stdout
    assert not list((tmp_path / "logs").rglob("*.png")) and not list((tmp_path / "logs").glob("*.jsonl"))
    run = launcher("run_pipeline.sh", tmp_path, MODEL="mlp", MICROBATCHES="3")
    assert run.returncode == 2
    assert run.stderr.splitlines() == ["error: BATCH_SIZE=64 is not divisible by MICROBATCHES=3; "
                                       "use BATCH_SIZE=63 or BATCH_SIZE=66"], run.stderr
    run = launcher("run_3d.sh", tmp_path, MODEL="mlp", RECOMPUTE="yes")
    assert run.stderr.splitlines() == ["error: RECOMPUTE=yes must be one of: 0 1"] and run.returncode == 2


def test_a_flag_that_has_a_knob_is_refused_with_the_knob(tmp_path):
    """--recompute would reach the baseline, which does not take it, and leave the log names silent."""
    for script, args, knob in (("run_pipeline.sh", ["--recompute"], "use RECOMPUTE=1 bash run_pipeline.sh"),
                               ("run_joint.sh", ["--micro", "2"], "use MICROBATCHES=2 bash run_joint.sh"),
                               ("run_tp.sh", ["--hybrid"], "use HYBRID=1 bash run_tp.sh"),
                               ("run_3d.sh", ["--steps=5"], "use STEPS=5 bash run_3d.sh")):
        run = launcher(script, tmp_path, args, MODEL="mlp")
        lines = run.stderr.splitlines()
        assert run.returncode == 2 and len(lines) == 1 and knob in lines[0], (script, run.stderr)
        assert "== baseline" not in run.stdout and not list((tmp_path / "logs").glob("*.jsonl"))


def test_an_extra_flag_the_baseline_does_not_take_is_refused_before_anything_trains(tmp_path):
    run = launcher("run_tp.sh", tmp_path, ["--sequence-parallel"], MODEL="vit")   # (--balance has a knob: BALANCE)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("error: run_tp.sh passes its extra flags to single_baseline.py too, which "
                               "refused them: unrecognized arguments: --sequence-parallel"), lines
    assert "== baseline" not in run.stdout
    run = launcher("run_pipeline.sh", tmp_path, ["--check"])   # not an abbreviated --checkpoint-dir
    assert run.returncode == 2 and run.stderr.startswith("error: --check compares one step with the full model"), \
        run.stderr


@pytest.mark.slow
def test_recompute_gets_its_own_logs_legend_and_titles_and_the_help_names_real_files(tmp_path):
    """The default run's files are the ones mp.tools.plot_curves's help names; RECOMPUTE=1 writes beside them."""
    run = launcher("run_pipeline.sh", tmp_path, STEPS="2")
    assert run.returncode == 0, run.stderr[-2000:]
    logs = tmp_path / "logs"
    named = [word for line in plot_curves.__doc__.replace("\\\n", " ").splitlines() if "mp.tools.plot_curves" in line
             for word in line.split() if word.startswith("logs/") and word.endswith((".json", ".jsonl"))]
    assert len(named) == 4
    tag = "_steps2_synthetic_evalevery0"     # what this run sets off the defaults (the help names the defaults')
    for path in named:
        assert (logs / path[len("logs/"):].replace("_cnn", "_cnn" + tag)).exists(), (path, sorted(os.listdir(logs)))
    plain = (logs / f"pipeline_cnn{tag}_1f1b_p4_m4_b64.jsonl").read_text()
    run = launcher("run_pipeline.sh", tmp_path, STEPS="2", RECOMPUTE="1", SCHEDULE="1f1b")
    assert run.returncode == 0, run.stderr[-2000:]
    assert (logs / f"pipeline_cnn{tag}_1f1b_p4_m4_b64.jsonl").read_text() == plain     # the run without it is kept
    records = [json.loads(line) for line in (logs / f"pipeline_cnn{tag}_1f1b_p4_m4_b64_recompute.jsonl").open()]
    assert "recompute" in plot_curves.label_of(records, "x")
    assert "recompute" not in plot_curves.label_of([json.loads(line) for line in plain.splitlines()], "x")
    trace = json.loads((logs / f"timeline_cnn{tag}_1f1b_p4_m4_b64_recompute.json").read_text())
    assert plot_timeline.gantt_title(trace["otherData"]).startswith("1f1b, --recompute: 4 stages")
    for png in (f"pipeline_loss{tag}.png", f"pipeline_timeline{tag}.png", f"pipeline_loss_1f1b{tag}_recompute.png",
                f"pipeline_timeline_1f1b{tag}_recompute.png"):
        assert (logs / "plots" / png).stat().st_size > 10_000, png


def test_the_parallel_arguments_are_checked_before_anything_trains(tmp_path):
    """--heads 4 cannot be split over 3 ranks: the launcher stops before the baseline trains."""
    run = launcher("run_tp.sh", tmp_path, MODEL="vit", NPROC="3", STEPS="2")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.splitlines() == ["error: --heads 4 is not divisible by the tensor-parallel degree NPROC=3; "
                                       "each rank needs whole heads: use 2 ranks (NPROC=2)"], run.stderr
    assert "== baseline" not in run.stdout and not list((tmp_path / "logs").glob("*.jsonl"))


def test_run_3d_plots_the_grid_against_the_baseline(tmp_path):
    run = launcher("run_3d.sh", tmp_path, ["--hidden", "32", "--layers", "4"], MODEL="mlp", STEPS="3", NPROC="4",
                   DP="1", TP="2", BATCH_SIZE="16")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "== 3-D: 1 replica x 2 stages x 2 tp ranks" in run.stdout
    png, = [path for path in written(run.stdout) if path.endswith(".png")]
    assert os.path.basename(png) == "3d_loss_mlp_nproc4_dp1_batchsize16_hidden32_layers4_steps3_synthetic_evalevery0.png"
    assert os.path.getsize(png) > 10_000
    assert "largest |loss - baseline| for parallel_3d (1f1b, dp=1, tp=2, m=4, 4 ranks, batch 16)" in run.stdout


def test_run_3d_checks_the_grid_before_anything_trains(tmp_path):
    run = launcher("run_3d.sh", tmp_path, MODEL="mlp", NPROC="6", STEPS="2")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("error: the world size NPROC=6 is not divisible by DP=2 x TP=2 = 4"), run.stderr
    assert "== baseline" not in run.stdout and not list((tmp_path / "logs").glob("*.jsonl"))


def test_a_refused_setting_answers_at_once_and_the_check_never_imports_torch(tmp_path):
    """Issue 47, item 4: a launcher checks every run's arguments in one python that does not import torch
    (mp/tools/check_args.py), so a refused setting answers at once (about 0.15 s on 2 idle cores; it took
    3-11 s when each check imported torch); CHECK_ONLY=1 checks everything and trains nothing. Shown, not
    timed (a busy machine made a timing fail): the refusals run with the real python and a torch that
    cannot be imported, so any import of torch on their way would be the error they print."""
    no_torch = without_torch(tmp_path)
    for script, knobs, line in (
            ("run_pipeline.sh", {"MICROBATCHES": "3"}, "error: BATCH_SIZE=64 is not divisible by MICROBATCHES=3"),
            ("run_pipeline.sh", {"SCHEDULE": "1f1b 2bw", "MICROBATCHES": "2"}, "error: SCHEDULE=2bw needs MICROBATCHES"),
            ("run_joint.sh", {"DP": "4"}, "error: the world size NPROC=6 is not divisible by DP=4"),
            ("run_tp.sh", {"MODEL": "vit", "NPROC": "3"}, "error: --heads 4 is not divisible"),
            ("run_3d.sh", {"NPROC": "6"}, "error: the world size NPROC=6 is not divisible by DP=2 x TP=2")):
        run = launcher(script, tmp_path, **knobs, **no_torch)
        assert run.returncode == 2 and run.stderr.startswith(line), (script, knobs, run.stderr)
        assert len(run.stderr.splitlines()) == 1, (script, knobs, run.stderr)
    run = launcher("run_pipeline.sh", tmp_path, ["--layers", "8"], MODEL="mlp", CHECK_ONLY="1",
                   SCHEDULE="gpipe 1f1b interleaved zb 2bw", **no_torch)
    said = [line for line in run.stdout.splitlines() if not line.startswith("note: ")]   # ranks over cores
    assert run.returncode == 0 and said == [
        "CHECK_ONLY=1: the knobs and the arguments of the 6 runs (the baseline's included) are good; nothing trained"]
    assert not (tmp_path / "logs").exists()
    for zero in ("2", "3"):                                                      # issue 44: ZeRO-2's and 3's knob
        run = launcher("run_joint.sh", tmp_path, CHECK_ONLY="1", ZERO=zero, **no_torch)
        assert run.returncode == 0 and "\nCHECK_ONLY=1: " in "\n" + run.stdout, run.stderr
    run = launcher("run_3d.sh", tmp_path, CHECK_ONLY="1", ZERO="4", **no_torch)
    assert run.returncode == 2 and run.stderr.splitlines() == ["error: ZERO=4 must be one of: 0 1 2 3"], run.stderr
    probe = ("import sys; from mp.tools import check_args; "
             "check_args.main(['4', 'pipeline_microbatch', '--balance', 'auto', '::', '6', 'pipeline_dp_joint', '::', "
             "'2', 'tensor_parallel', '--hybrid', '::', '8', 'parallel_3d', '::', '1', 'single_baseline']); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", (run.stdout, run.stderr)


def test_nccl_without_a_gpu_is_refused_before_the_baseline_in_the_knobs_terms(tmp_path):
    """Issue 67, item 2: BACKEND=nccl on a machine without a GPU trained the whole baseline, then the
    ranks refused, naming NCCL versions and --backend gloo. Now the check before anything trains
    says there is no GPU and names the knob, without the 2-3 s an import of torch takes (run with a torch
    that cannot be imported, as above)."""
    if glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"):
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    run = launcher("run_ep.sh", tmp_path, BACKEND="nccl", STEPS="30", **without_torch(tmp_path))
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "error: BACKEND=nccl runs on GPUs, one a rank at world size NPROC=2, and this machine shows none (no NVIDIA "
        "GPU or driver found); use BACKEND=gloo (the CPU), or BACKEND=auto, which takes gloo where there is no GPU"], \
        run.stderr
    assert "== baseline" not in run.stdout and not (tmp_path / "logs").exists()


def test_a_flag_no_program_takes_names_the_launcher_the_program_and_the_knob(tmp_path):
    """Issue 67, item 4: `bash run_ep.sh --num-experts 8` said "unrecognized arguments" alone."""
    run = launcher("run_ep.sh", tmp_path, ["--num-experts", "8"])
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "error: run_ep.sh passes its extra flags to expert_parallel.py and single_baseline.py, and expert_parallel.py "
        "does not take --num-experts 8 (python expert_parallel.py --help lists its flags); to set experts, use the "
        "knob: EXPERTS=8 bash run_ep.sh"], run.stderr


def test_more_ranks_than_cores_is_said_once_by_the_launcher(tmp_path):
    """Issue 85, item 2c: the ranks outnumber the cores (here one core: taskset's limit): one note, what
    it does to step times and to the measured bubble, said by the launcher's check of every run."""
    env = dict({k: v for k, v in os.environ.items() if k != "MP_CORES_NOTED"},   # conftest.py: said, elsewhere
               PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), DATA="synthetic", CHECK_ONLY="1",
               SCHEDULE="gpipe 1f1b", NPROC="2")
    run = subprocess.run(["bash", os.path.join(ROOT, "run_pipeline.sh")], env=env, capture_output=True, text=True,
                         timeout=60, preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: ")]
    assert run.returncode == 0 and notes == [
        "note: 2 ranks share this machine's 1 core, at most 1 computing at once: step times are longer than with a "
        "core a rank, and a pipeline's measured bubble counts a rank's wait for a core as idle time (the losses are "
        "the same)"], run.stdout + run.stderr


def test_a_mistyped_extra_flag_names_the_flag_it_is_close_to(tmp_path):
    """Issue 85, item 2a: under a launcher too, `--hiden 64` names --hidden."""
    run = launcher("run_tp.sh", tmp_path, ["--hiden", "64"])
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "error: run_tp.sh passes its extra flags to tensor_parallel.py and single_baseline.py, and tensor_parallel.py "
        "does not take --hiden 64 (python tensor_parallel.py --help lists its flags); did you mean --hidden?"], \
        run.stderr


@pytest.mark.parametrize("script", ["run_5d.sh", "run_cp.sh", "run_ep.sh"])
def test_a_launcher_given_a_model_its_lesson_does_not_run_says_which_it_runs(tmp_path, script):
    """Issue 85, item 2b: `bash run_5d.sh --model mlp` told the student to drop EXPERTS and TOP_K, which
    they never set; it says what the lesson runs and where the mlp is trained."""
    for args, knobs in ((["--model", "mlp"], {}), ([], {"MODEL": "mlp"})):   # the extra flag or the knob
        run = launcher(script, tmp_path, args, **knobs)
        lines = run.stderr.splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert lines[0].startswith(f"error: {script} trains the vit or the gpt, the models ") and lines[0].endswith(
            "; drop --model mlp (MODEL=mlp), or train the mlp with another launcher: MODEL=mlp bash run_3d.sh (or "
            "run_pipeline.sh, run_joint.sh, run_tp.sh)") and "EXPERTS" not in lines[0], lines
    assert launcher(script, tmp_path, [], MODEL="gpt", CHECK_ONLY="1").returncode == 0


def test_a_later_run_names_what_a_failed_one_left_unfinished(tmp_path):
    """Issue 67, item 2: a failed run's folder in logs/.unfinished/ (other settings: the later run does
    not take it over) is named by the next run of the launcher that finishes, with its command."""
    failed = launcher("run_tp.sh", tmp_path, ["--hidden", "32"], MODEL="mlp", STEPS="2",
                      PYTHON=failing_torchrun(tmp_path))
    assert failed.returncode == 1, failed.stderr[-2000:]
    left, = (tmp_path / "logs" / ".unfinished").iterdir()
    run = launcher("run_tp.sh", tmp_path, ["--hidden", "32"], MODEL="mlp", STEPS="3")
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"note: an earlier run of run_tp.sh that did not finish left {os.path.realpath(left)} (DATA=synthetic EVAL_EVERY=0 " \
           f"MODEL=mlp STEPS=2 bash run_tp.sh --hidden 32): run that again to finish it, or delete the folder" in \
           run.stdout.replace(str(tmp_path), os.path.realpath(tmp_path)), run.stdout


def test_the_bubble_line_says_why_it_exceeds_the_theory_when_ranks_share_cores(tmp_path, monkeypatch, capsys):
    """Issue 85, item 2d: "bubble measured 77.3%, theory 42.9%" on 4 ranks and 2 cores says why they differ."""
    from mp.pp import timeline
    monkeypatch.setattr("mp.errors.cores", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    trace = {"traceEvents": [], "otherData": {"bubble_measured": 0.773, "bubble_theory": 0.429, "stages": 4,
                                              "device": "cpu"}}
    timeline.write_timeline(trace, str(tmp_path / "t.json"), True)
    assert capsys.readouterr().out == (f"wrote {tmp_path / 't.json'}: bubble measured 77.3%, theory 42.9% (4 ranks "
                                       f"share this machine's 2 cores, at most 2 computing at once: a stage waiting "
                                       f"for a core counts as idle)\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    timeline.write_timeline(trace, str(tmp_path / "t.json"), True)
    assert capsys.readouterr().out.endswith("theory 42.9%\n")


def test_the_cp_and_ep_launchers_take_model_gpt_and_refuse_the_vits_patch_for_it(tmp_path):
    """MODEL=gpt: the causal language model through run_cp.sh and run_ep.sh (checked, nothing trains);
    PATCH_SIZE is the vit's, the gpt's sequence is --seq-len; a model neither lesson runs is one line."""
    for script in ("run_cp.sh", "run_ep.sh"):
        run = launcher(script, tmp_path, ["--seq-len", "32", "--loss-mask", "prefix"], MODEL="gpt", CHECK_ONLY="1")
        assert run.returncode == 0 and "nothing trained" in run.stdout, (script, run.stderr[-2000:])
    run = launcher("run_cp.sh", tmp_path, [], MODEL="gpt", PATCH_SIZE="2", CHECK_ONLY="1")
    assert run.returncode == 2 and "PATCH_SIZE=2 is the vit's; the gpt's sequence is --seq-len" in run.stderr
    run = launcher("run_ep.sh", tmp_path, [], MODEL="cnn", CHECK_ONLY="1")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "MODEL=cnn" in lines[0] and "the gpt" in lines[0], run.stderr
