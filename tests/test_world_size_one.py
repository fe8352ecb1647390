"""Every program in one process (`python prog.py`, world size 1, as on one GPU) with every flag:
--check, --timeline, evaluation, the joint program with --dp 1; interleaved on one stage is refused."""
import json

import pytest

import pipeline_microbatch as pm
from helpers import FAST, assert_same_losses, launch

MLP = FAST + ["--model", "mlp", "--hidden", "16", "--layers", "4", "--batch-size", "8", "--steps", "4"]


@pytest.mark.parametrize("program,extra", [
    ("pipeline_microbatch.py", []), ("pipeline_dp_joint.py", ["--dp", "1", "--microbatches", "4"]),
    ("tensor_parallel.py", [])])
def test_check_in_one_process(tmp_path, program, extra):
    run = launch(program, MLP + extra + ["--check"], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "match" in run.stdout and "MISMATCH" not in run.stdout + run.stderr


@pytest.mark.parametrize("program,extra", [
    ("pipeline_microbatch.py", ["--timeline", "t.json", "--schedule", "gpipe"]),
    ("pipeline_dp_joint.py", ["--dp", "1", "--microbatches", "4", "--timeline", "t.json"]),
    ("tensor_parallel.py", [])])
def test_training_with_timeline_and_eval_matches_the_baseline(tmp_path, baseline, program, extra):
    args = MLP + ["--eval-every", "2"]
    run = launch(program, args + extra, tmp_path)
    base = baseline(args)
    assert_same_losses(run, base)
    assert [e["test_loss"] for e in run.events("eval")] == pytest.approx(
        [e["test_loss"] for e in base.events("eval")], abs=1e-4)
    summary = run.events("summary")[0]
    kind = "cuda peak" if run.events("config")[0]["device"].startswith("cuda") else "cpu peak RSS"  # auto: nccl on a GPU
    assert list(summary["peak_memory_mb"]) == ["0"] and summary["peak_memory_kind"].startswith(kind)
    if "--timeline" in extra:
        trace = json.loads((tmp_path / "t.json").read_text())
        assert trace["otherData"]["stages"] == 1 and trace["otherData"]["bubble_theory"] == 0
        assert {e["name"] for e in trace["traceEvents"]} >= {"F0", "B3"}
    if program != "pipeline_microbatch.py":   # a group of one rank has nothing to compare: no replica line
        assert "bit-identical" not in run.stdout, run.stdout


def test_interleaved_on_one_stage_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exit_:
        pm.parse_args(MLP + ["--schedule", "interleaved"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --schedule interleaved needs at least 2 stages"), err
