"""Nothing a user made is lost, and every mistyped setting is refused: each run keeps its own files
(settings in the names, logs complete or absent under their final name), two launchers at once both
finish, Ctrl-C leaves one line and the earlier log untouched, a typo in a knob or a flag stops the
run with the fix, and the one error line reaches the user however the ranks race."""
import os
import signal
import subprocess
import sys
import time

import pytest

import single_baseline
from helpers import FAST, PYTHON, ROOT, assert_one_error_line, launch, read_log, written

SMALL = ["--hidden", "16", "--layers", "4"]


def launcher(script, tmp_path, args=SMALL, python=PYTHON, **knobs):
    env = dict(os.environ, PYTHON=python, LOGS=str(tmp_path / "logs"), DATA="synthetic", EVAL_EVERY="0",
               OMP_NUM_THREADS="1", MODEL="mlp")
    env.update(knobs)
    return subprocess.Popen(["bash", os.path.join(ROOT, script), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finished(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def snapshot(folder):
    return {p: open(p, "rb").read() for p in map(str, folder.rglob("*")) if os.path.isfile(p)}


@pytest.mark.slow
def test_two_launchers_at_once_share_the_baseline_log_and_both_plot(tmp_path):
    """run_tp.sh and run_joint.sh with the same model, data and batch write the same baseline log: each
    writes its own partial file and renames it, so both finish and both plot."""
    runs = [launcher("run_tp.sh", tmp_path, STEPS="40", NPROC="2", BATCH_SIZE="24"),
            launcher("run_joint.sh", tmp_path, STEPS="40", NPROC="4", DP="2", MICROBATCHES="2", BATCH_SIZE="24")]
    results = [finished(run) for run in runs]
    for code, out, err in results:
        assert code == 0, err[-2000:]
    tp, joint = (written(out) for _, out, _ in results)
    assert tp[0] == joint[0] and os.path.basename(tp[0]).startswith("single_baseline_mlp_")   # the one shared log
    baseline = read_log(tp[0])
    assert [r["step"] for r in baseline if r["event"] == "train"] == list(range(40)) and baseline[-1]["event"] == "summary"
    assert all(os.path.getsize(path) > 0 for path in tp + joint)
    assert not list((tmp_path / "logs").glob("*.partial-*")), "a partial log outlived its complete run"


@pytest.mark.slow
def test_a_run_with_other_settings_keeps_the_earlier_runs_files_and_a_rerun_replaces_only_its_own(tmp_path):
    code, out, err = finished(launcher("run_tp.sh", tmp_path, STEPS="4"))
    assert code == 0, err[-2000:]
    first, before = written(out), snapshot(tmp_path / "logs")
    code, out, err = finished(launcher("run_tp.sh", tmp_path, STEPS="3", SEED="1"))
    assert code == 0, err[-2000:]
    second = written(out)
    assert not set(first) & set(second) and all("_steps3_seed1_" in os.path.basename(p) for p in second)
    assert {p: v for p, v in snapshot(tmp_path / "logs").items() if p in before} == before   # byte for byte
    code, out, err = finished(launcher("run_tp.sh", tmp_path, STEPS="4"))
    assert code == 0 and written(out) == first, err[-2000:]                 # the same settings: the same files
    assert sorted(snapshot(tmp_path / "logs")) == sorted(set(before) | set(second))


@pytest.mark.slow
def test_ctrl_c_says_one_line_keeps_the_partial_log_and_leaves_the_earlier_set_as_it_was(tmp_path):
    """SIGINT to the launcher's process group, as a terminal sends it, with the real python and
    torchrun (the zygote's ranks are not in that group), once the rerun's baseline has finished and its
    tensor-parallel run is training: exit 130, one line naming the kept partial log and one naming the
    finished baseline log left in the run's folder (issue 85, item 2e), every file of the
    run before (both logs and the figure) byte for byte, no process left; this run's files so far in
    its own folder. A rerun to the end then replaces the set and says so in one line (issue 59)."""
    code, out, err = finished(launcher("run_tp.sh", tmp_path, STEPS="150"))
    assert code == 0, err[-2000:]
    first, before = written(out), snapshot(tmp_path / "logs")
    assert len(first) == 3 and sorted(before) == sorted(first)            # two logs and the figure, nothing else
    run = launcher("run_tp.sh", tmp_path, STEPS="150", python=sys.executable)
    logs = tmp_path / "logs"
    deadline = time.time() + 120
    while not any(len(read_log(str(p))) > 3 for p in logs.rglob("tensor_parallel_*.partial-*.jsonl")):
        assert time.time() < deadline and run.poll() is None, "the tensor-parallel run did not start"
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    code, out, err = finished(run, timeout=60)
    partial, = logs.rglob("tensor_parallel_*.partial-*.jsonl")
    stage = partial.parent.parent
    line, parked = err.splitlines()   # the rank's, then the launcher's: the finished baseline log stays in stage
    assert code == 130 and line.startswith("interrupted at step "), err
    assert f"in {partial}" in line and "Traceback" not in err + out
    assert parked.startswith(f"note: interrupted, so the finished logs/{os.path.basename(first[0])} stayed in {stage},")
    now = snapshot(tmp_path / "logs")
    assert {p: now[p] for p in before} == before                            # the earlier set, whole
    assert stage.parent.name == ".unfinished" and (stage / "logs" / os.path.basename(first[0])).exists()
    steps = [r["step"] for r in read_log(str(partial)) if r["event"] == "train"]
    assert steps == list(range(len(steps))) and f"kept steps 0-{steps[-1]} " in err
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes left running: {left}"
    code, out, err = finished(launcher("run_tp.sh", tmp_path, STEPS="150"))
    assert code == 0 and written(out) == first, err[-2000:]
    assert f"replaced the earlier run's files: {', '.join(first)}" in out.splitlines(), out[-2000:]
    assert sorted(snapshot(tmp_path / "logs")) == sorted(first) and not stage.exists()


@pytest.mark.parametrize("script,knobs,message", [
    ("run_pipeline.sh", dict(SCHEDUEL="zb"), "error: SCHEDUEL is set, and run_pipeline.sh has no such knob: "
                                             "did you mean SCHEDULE?"),
    ("run_tp.sh", dict(SCHEDULE="zb"), "error: SCHEDULE is a knob of run_3d.sh, run_5d.sh, run_joint.sh, "
                                       "run_pipeline.sh, run_slurm.sh, not of run_tp.sh, which would ignore it"),
    ("run_joint.sh", dict(steps="5"), "error: steps is set, and run_joint.sh has no such knob: did you mean STEPS?"),
    ("run_3d.sh", dict(NPROCS="4"), "error: NPROCS is set, and run_3d.sh has no such knob: did you mean NPROC?"),
    ("run_pipeline.sh", dict(HYBRID="1"), "error: HYBRID is a knob of run_tp.sh, not of run_pipeline.sh"),
    ("run_tp.sh", dict(PYTHON="false"), "error: PYTHON=false cannot import torch: set up once with "
                                        "'python3 -m venv .venv && source .venv/bin/activate && pip install"),
], ids=["typo", "another-launchers", "lower-case", "extra-letter", "hybrid-elsewhere", "no-torch"])
def test_a_mistyped_or_misplaced_knob_is_refused_before_anything_runs(tmp_path, script, knobs, message):
    code, out, err = finished(launcher(script, tmp_path, **knobs))
    assert code == 2 and err.count("\n") == 1 and err.startswith(message), err
    assert not (tmp_path / "logs").exists() and not out


def test_schedules_is_the_old_name_of_schedule_with_a_note(tmp_path):
    code, out, err = finished(launcher("run_pipeline.sh", tmp_path, SCHEDULES="1f1b zb", MICROBATCHES="3"))
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0] == 'note: SCHEDULES is SCHEDULE\'s old name (every launcher spells it SCHEDULE now): running ' \
                       'SCHEDULE="1f1b zb"'
    assert lines[1].startswith("error: BATCH_SIZE=64 is not divisible by MICROBATCHES=3")
    code, out, err = finished(launcher("run_pipeline.sh", tmp_path, SCHEDULES="zb", SCHEDULE="1f1b"))
    assert code == 2 and "SCHEDULES is SCHEDULE's old name: unset SCHEDULES" in err


@pytest.mark.parametrize("argv,message", [
    (["--layer", "6"], "error: unrecognized arguments: --layer 6"),            # no abbreviations
    (["--model", "cnn", "--layers", "6"], "error: --model cnn does not use --layers"),
    (["--model", "mlp", "--heads=2"], "error: --model mlp does not use --heads (it reads --layers, --hidden)"),
    (["--model", "cnn", "--hidden", "8", "--heads", "2"], "error: --model cnn does not use --hidden, --heads"),
])
def test_an_abbreviated_flag_or_one_the_model_does_not_read_is_refused(argv, message, monkeypatch, capsys):
    assert_one_error_line(single_baseline.parse_args, FAST + argv, 1, message, monkeypatch, capsys)


def test_the_error_line_reaches_the_user_when_the_printing_rank_is_the_slowest(tmp_path, monkeypatch):
    """Every rank sees the bad input, rank 0 prints it. Here rank 0 starts 3 s late (a sitecustomize
    that sleeps on rank 0, as a loaded machine would make it): the other ranks wait for it instead of
    exiting first and having torchrun stop rank 0 before it printed."""
    slow_site = tmp_path / "site"
    slow_site.mkdir()
    (slow_site / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(slow_site), os.environ.get("PYTHONPATH")])))
    run = launch("tensor_parallel.py", ["--data", "synthetic", "--model", "vit", "--heads", "3", "--hidden", "48"],
                 tmp_path, nproc=4, timeout=60)
    assert run.exited(2) and run.stderr.count("error: --heads 3 is not divisible by the tensor-parallel degree 4") == 1, \
        run.stderr


@pytest.mark.slow
def test_the_launchers_torchrun_leaves_the_programs_line_as_the_last_word(tmp_path):
    """python -m mp.tools.torchrun (what the launchers run): a rank's bad input is one line and the
    rank's own exit status 2, without torchrun's 40-line report; a rank killed by a signal is named."""
    cmd = [sys.executable, "-m", "mp.tools.torchrun", "--standalone", "--nproc-per-node", "2", "--",
           "tensor_parallel.py", "--data", "synthetic", "--model", "vit", "--heads", "3", "--hidden", "48"]
    run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == ["error: --heads 3 is not divisible by the tensor-parallel degree 2; each "
                                       "rank needs whole heads: use --heads 2 or --heads 4 or 3 ranks (torchrun "
                                       "--nproc-per-node 3)"], run.stderr
    dies = tmp_path / "dies.py"
    dies.write_text("import os, signal, time\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                    "time.sleep(60)\n")
    run = subprocess.run(cmd[:6] + [str(dies)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.splitlines()
    assert run.returncode == 128 + 9 and len(lines) == 1, run.stderr
    assert lines[0].startswith("error: rank 1 (pid ") and lines[0].endswith(" was killed by SIGKILL"), lines


@pytest.mark.slow
@pytest.mark.parametrize("program", ["single_baseline.py", "pipeline_microbatch.py", "pipeline_dp_joint.py",
                                     "tensor_parallel.py", "parallel_3d.py"])
def test_ctrl_c_during_start_up_says_one_line(program, tmp_path):
    """Issue 43, item 4: a Ctrl-C while `import torch` and the rest of start-up run (the real python, not
    the zygote, whose ranks have imported everything): one line, exit 130, no traceback. Interrupted at
    0.3 s (inside the imports on 2 cores) and at 1.5 s (later in start-up). One process, so the grid
    programs get a grid of one (their default --dp 2 would be refused at once, and the signal could
    land while the refused process exits)."""
    one = {"pipeline_dp_joint.py": ["--dp", "1"], "parallel_3d.py": ["--dp", "1", "--tp", "1"]}.get(program, [])
    for delay in (0.3, 1.5):
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, program), "--data", "synthetic", "--steps", "500",
                                 *one, "--log-file", str(tmp_path / "log.jsonl")], cwd=str(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, (delay, err[-2000:])


@pytest.mark.parametrize("script", ["run_pipeline.sh", "run_joint.sh", "run_tp.sh", "run_3d.sh", "run_slurm.sh"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_a_launchers_help_is_its_own_usage_at_once(script, flag, tmp_path):
    """Issue 47, item 1: --help / -h prints the launcher's usage (its examples, every knob with its
    default, where the files go) and exits 0 at once: no python runs, nothing trains or is written."""
    start = time.perf_counter()
    proc = subprocess.run(["bash", os.path.join(ROOT, script), "--layers", "6", flag], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHON="false"))
    took = time.perf_counter() - start
    assert proc.returncode == 0 and not proc.stderr and took < 1.5, (proc.returncode, proc.stderr, took)
    out = proc.stdout
    run = "sbatch" if script == "run_slurm.sh" else "bash"   # run_slurm.sh is submitted, the others run
    assert out.startswith(f"usage: [KNOB=value ...] {run} {script}") and f"{run} {script}" in out.split("\n", 3)[-1]
    assert all(f"  {knob} " in out for knob in ("NPROC", "STEPS", "DATA", "SEED", "LOGS", "PLOTS")), out
    assert "$LOGS (default logs/)" in out and out.count("usage:") == 1
    assert not (tmp_path / "logs").exists() and not os.listdir(tmp_path)


def as_a_terminal_starts_it():
    """In the job's first process, before bash: SIGINT at its default and unblocked, as a terminal starts a
    job. Both are inherited from the test runner's process, and a bash that starts with SIGINT ignored can
    never trap it: it runs on after the Ctrl-C, exit 0, as both tests did three times under the whole suite
    with -n 2 (and do in a runner that ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


@pytest.mark.slow
def test_a_ctrl_c_that_lands_as_a_step_ends_well_still_stops_the_launcher(tmp_path):
    """The race CI once hit: SIGINT reaches the job while a step is ending with status 0, and bash,
    seeing a child that exited normally, would take the signal as handled and run on. Here the step
    ignores SIGINT and ends well; the launchers' INT trap (mp/tools/launch_checks.sh) still stops the
    script, silently, with 130. The signal goes once the step says it ignores SIGINT (a file it makes),
    not after a guessed delay."""
    script, ready = tmp_path / "launcher.sh", tmp_path / "ignoring"
    script.write_text(f'set -euo pipefail\ncd {ROOT}\nsource ./mp/tools/launch_checks.sh\n'
                      f'{sys.executable} -c "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); '
                      f'open(\'{ready}\', \'w\').close(); time.sleep(1.5)"\necho ran on\n')
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_a_terminal_starts_it)
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (130, "", ""), (proc.returncode, out, err)


MOMENT_SITE = os.path.join(ROOT, "tests", "moment_site")   # its sitecustomize.py holds a python at a moment


def tool_launcher(tmp_path):
    """A launcher that runs one tool (ARGS: python's arguments) as the run_*.sh launchers run theirs."""
    path = tmp_path / "tool.sh"
    path.write_text(f'set -euo pipefail\ncd {ROOT}\nsource ./mp/tools/launch_checks.sh\nSTEP=tool\nrun_python "$@"\n')
    return ["bash", str(path)]


def first_step_logged(folder):
    """Whether a run logging to FOLDER/tp.jsonl has logged its first step (in its partial log)."""
    return any('"train"' in p.read_text() for p in folder.glob("tp.partial-*.jsonl"))


def bash_started(pid):
    """Has process pid become bash (exec'd)? Signalled earlier, the forked python about to exec it takes
    SIGINT with python's own handler, and bash never sees it. Without /proc (macOS): at once."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("bash")
    except OSError:
        return not os.path.isdir("/proc")


def interrupted_at(cmd, moment, folder, env):
    """Start cmd in a session of its own, as a terminal starts a job; at `moment` send SIGINT to the
    whole session, as a terminal's Ctrl-C does; return (exit status, stdout, stderr). moment "bash":
    as soon as the launcher's bash has started (exec'd: bash_started); "first step": once the run's log (FOLDER/tp.jsonl) has
    its first step; "WHO@WHERE": once tests/moment_site holds that python there (its docstring), which
    it releases only once the signal has reached it."""
    env = dict(env, MOMENTS=str(folder), MOMENT=moment,
               PYTHONPATH=os.pathsep.join(filter(None, [MOMENT_SITE, os.environ.get("PYTHONPATH")])))
    reached = {"bash": lambda: bash_started(proc.pid), "first step": lambda: first_step_logged(folder)}.get(
        moment, lambda: (folder / "reached").exists())
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_a_terminal_starts_it)
    deadline = time.monotonic() + 120
    while not reached():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{moment} was never reached: exit status {proc.returncode}, {err[-2000:]}")
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    try:   # a rank in a C++ wait leaves at once too (mp/errors.py _leave_from_any_wait): seconds, even under load
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the agent, and with it every rank (mp/errors.py end_with_launcher)
        out, err = proc.communicate()
        pytest.fail(f"still running 120 s after the Ctrl-C at {moment}: {err[-2000:]}")
    return proc.returncode, out, err


@pytest.mark.slow   # a fault test (docs/running.md#tests): each moment's Ctrl-C waits for a real python
def test_ctrl_c_while_a_launcher_or_its_tools_start_says_at_most_one_line(tmp_path):
    """Issues 43 (item 4) and 61: SIGINT to the whole process group, as a terminal's Ctrl-C sends it, at
    each moment of a launcher's start: bash has just started; a python the launcher starts is still
    importing `site`, before any line of ours runs (the knobs' check, the arguments' check, the baseline,
    torchrun's agent, the plot); the program imports torch (matplotlib for the plot); the ranks have
    logged their first step (torchrun passes the Ctrl-C on to them: each stops, the log so far is kept).
    Exit status 130 (or, at "bash", the shell's own death by SIGINT, which a shell also shows as 130), at
    most one line, never a traceback or python's "Fatal Python error: init_import_site", no figure.

    The moments are waited for, not guessed with a delay: tests/moment_site/sitecustomize.py (on
    PYTHONPATH) holds the one python named by MOMENT there until the signal has reached it. Held inside
    site's import of sitecustomize, the signal lands in the interpreter's real start-up (init_import_site,
    the issue's failure), on a quiet machine as on a busy one. The real interpreter runs every python
    here, not tests/python (the zygote's stand-in would be the one starting, not the program). The tools,
    which only a whole run reaches, run from a launcher of five lines that starts them as the run_*.sh
    launchers do (tool_launcher: run_python, mp/tools/launch_checks.sh), once more with an `env` that has no
    --block-signal (macOS's, coreutils before 8.31), where run_python blocks SIGINT with perl."""
    env = dict(os.environ, PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), DATA="synthetic", STEPS="2",
               OMP_NUM_THREADS="1")
    old_env = tmp_path / "old_env"
    old_env.mkdir()
    (old_env / "env").write_text("#!/bin/sh\necho 'env: unrecognized option' >&2\nexit 125\n")
    (old_env / "env").chmod(0o755)
    perl = dict(env, PATH=f"{old_env}{os.pathsep}{env['PATH']}")
    run_tp, tool = ["bash", os.path.join(ROOT, "run_tp.sh")], tool_launcher(tmp_path)
    cases = [("run_tp", "bash", env), ("run_tp", "mp.tools.knobs@site", env),
             ("run_tp", "mp.tools.check_args@site", env),
             ("run_tp", "single_baseline.py@site", env), ("run_tp", "single_baseline.py@torch", env),
             ("torchrun", "mp.tools.torchrun@site", env), ("torchrun", "mp.tools.torchrun@torch", env),
             ("torchrun", "first step", env),
             ("plot", "mp.tools.plot_curves@site", env), ("plot", "mp.tools.plot_curves@matplotlib", env),
             ("plot", "mp.tools.plot_curves@site", perl)]
    for i, (what, moment, case_env) in enumerate(cases):
        folder = tmp_path / f"moment{i}"
        folder.mkdir()
        cmd = {"run_tp": run_tp,
               "torchrun": tool + ["-m", "mp.tools.torchrun", "--standalone", "--nproc-per-node", "2", "--",
                                   "tensor_parallel.py", *FAST, "--model", "mlp", *SMALL, "--log-file",
                                   str(folder / "tp.jsonl")],
               "plot": tool + ["-m", "mp.tools.plot_curves", "a.jsonl", "-o", str(folder / "a.png")]}[what]
        code, out, err = interrupted_at(cmd, moment, folder, case_env)
        assert code == 130 or (moment == "bash" and code == -signal.SIGINT), (moment, code, err[-2000:])
        assert "Traceback" not in err + out and "Fatal Python error" not in err, (moment, err[-2000:])
        assert not err or (err.startswith("interrupted ") and err.count("\n") == 1), (moment, err[-2000:])
        if moment == "first step":   # the ranks stopped mid-run, and the log of the steps so far is kept
            partial, = folder.glob("tp.partial-*.jsonl")
            assert err.startswith("interrupted at step ") and f"in {partial}" in err, err
    assert not list(tmp_path.rglob("*.png"))


@pytest.mark.parametrize("script", ["run_pipeline.sh", "run_joint.sh", "run_tp.sh", "run_3d.sh", "run_cp.sh"])
def test_a_launcher_starts_every_python_with_sigint_blocked(script):
    """The test above interrupts run_tp.sh and the tools as a launcher starts them; here every launcher's
    every python goes through run_python (SIGINT blocked until the program's handler is in place), none
    through "$PYTHON" itself. run_slurm.sh is a batch job: no terminal sends it a Ctrl-C."""
    with open(os.path.join(ROOT, script)) as f:
        code = [line.split("#", 1)[0] for line in f]
    starts = [line for line in code if "run_python " in line]
    assert starts and not [line for line in code if '"$PYTHON"' in line or "${PYTHON}" in line], script


def test_ctrl_c_while_torchruns_new_python_ranks_start_says_at_most_one_line(tmp_path):
    """Ranks that are new pythons (with a GPU; MP_TORCHRUN_FORK=0 takes that path here) lead sessions of
    their own: a Ctrl-C reaches them through torchrun's agent, which passes SIGINT on. Rank 0 held in
    its `site` import (tests/moment_site) until the agent's SIGINT reached it: the job still ends with
    exit 130 and at most one line, with no "Fatal Python error" from a rank."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", MP_TORCHRUN_FORK="0")
    cmd = tool_launcher(tmp_path) + ["-m", "mp.tools.torchrun", "--standalone", "--nproc-per-node", "2", "--",
                                     "tensor_parallel.py", "--data", "synthetic", "--log-file",
                                     str(tmp_path / "tp.jsonl")]
    code, out, err = interrupted_at(cmd, "tensor_parallel.py@site", tmp_path, env)
    assert code == 130 and "Traceback" not in err + out and "Fatal Python error" not in err, (code, err[-2000:])
    assert not err or (err.startswith("interrupted ") and err.count("\n") == 1), err[-2000:]
    assert not list(tmp_path.glob("tp*.jsonl"))


@pytest.mark.slow   # a fault test, with the real python and torchrun
def test_ctrl_c_after_the_baseline_names_its_finished_log_left_in_the_runs_folder(tmp_path):
    """Issue 85, item 2e: interrupted while the parallel run starts, the launcher leaves the baseline's
    finished log in logs/.unfinished/ (files move only when every run has finished): its line names it."""
    env = dict(os.environ, PYTHON=sys.executable, LOGS=str(tmp_path / "logs"), DATA="synthetic", STEPS="2",
               EVAL_EVERY="0", MODEL="mlp", NPROC="2", OMP_NUM_THREADS="1", MP_TORCHRUN_FORK="0")
    code, out, err = interrupted_at(["bash", os.path.join(ROOT, "run_tp.sh"), *SMALL], "tensor_parallel.py@torch",
                                    tmp_path, env)
    stage, = (tmp_path / "logs" / ".unfinished").iterdir()
    log, = (stage / "logs").glob("single_baseline_*.jsonl")
    assert code == 130 and "Traceback" not in err, (code, err[-2000:])
    assert err.splitlines()[-1] == (f"note: interrupted, so the finished logs/{log.name} stayed in {stage}, not moved "
                                    f"to {tmp_path / 'logs'}: the same command again finishes the run (and moves the "
                                    f"files), or delete the folder"), err
