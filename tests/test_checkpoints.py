"""Checkpoints (mp/checkpoint.py): resume in any layout with the uninterrupted baseline's losses,
survive a killed rank under torchrun --max-restarts, and refuse what they cannot load."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import FAST, ROOT, assert_one_error_line, launch, peer_lost, read_log
from mp.log import newest_log

MLP = FAST + ["--model", "mlp", "--layers", "5", "--hidden", "32", "--batch-size", "16",
              "--dropout", "0.1", "--clip-grad-norm", "0.1"]


def steps(n):
    return ["--steps", str(n)]


def losses(run):
    assert run.returncode == 0, run.stderr[-3000:]
    return {r["step"]: r["loss"] for r in run.events("train")}


def assert_continues(run, reference, first, last):
    """The resumed run logs steps first..last-1 (after the earlier run's records) as the reference."""
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(last)), sorted(got)
    worst = max(abs(got[k] - want[k]) for k in range(first, last))
    assert worst <= 1e-4, f"largest |loss - uninterrupted| after the resume = {worst:.3g}"
    resume, = run.events("resume")
    assert resume["step"] == first
    return worst


@pytest.mark.slow
def test_resume_across_four_layout_changes(tmp_path, baseline):
    """pipeline 4 stages -> tensor parallel 2 -> 3-D 2 x 2 x 2 -> baseline, 3 steps each, one directory."""
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "3"]
    uninterrupted = baseline(MLP + steps(12))
    first = launch("pipeline_microbatch.py", MLP + ck + steps(3), tmp_path, nproc=4, log_name="run.jsonl")
    assert max(abs(a - losses(uninterrupted)[k]) for k, a in losses(first).items()) <= 1e-4
    chain = [("tensor_parallel.py", [], 2, "pipeline_microbatch"),
             ("parallel_3d.py", ["--dp", "2", "--tp", "2", "--microbatches", "2"], 8, "tensor_parallel"),
             ("single_baseline.py", [], 1, "parallel_3d")]
    for k, (program, extra, nproc, writer) in enumerate(chain, start=1):
        run = launch(program, MLP + ck + extra + steps(3 * (k + 1)), tmp_path, nproc=nproc, log_name="run.jsonl")
        assert_continues(run, uninterrupted, 3 * k, 3 * (k + 1))
        assert run.events("resume")[0]["from"]["program"] == writer
        assert f"note: resumed from {tmp_path / 'ck'}/step-{3 * k:08d} at step {3 * k}" in run.stdout


def test_resume_in_the_same_layout_is_bit_identical(tmp_path):
    args = MLP + ["--microbatches", "2"]
    whole = launch("pipeline_microbatch.py", args + steps(8), tmp_path, nproc=2, log_name="whole.jsonl")
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2"]
    launch("pipeline_microbatch.py", args + ck + steps(4), tmp_path, nproc=2, log_name="split.jsonl")
    resumed = launch("pipeline_microbatch.py", args + ck + steps(8), tmp_path, nproc=2, log_name="split.jsonl")
    assert losses(resumed) == losses(whole)                          # every step, to the bit
    assert sorted(os.listdir(tmp_path / "ck")) == [f"step-{k:08d}" for k in (2, 4, 6, 8)]


def test_a_killed_save_leaves_the_previous_checkpoint(tmp_path, baseline):
    """A save killed before its commit leaves .step-K.partial (no meta.json): resuming ignores it,
    continues from the checkpoint before, and the next save of step K replaces it."""
    ck = tmp_path / "ck"
    launch("single_baseline.py", MLP + ["--checkpoint-dir", str(ck), "--save-every", "3"] + steps(6), tmp_path)
    os.rename(ck / "step-00000006", ck / ".step-00000006.partial")
    os.remove(ck / ".step-00000006.partial" / "meta.json")
    run = launch("single_baseline.py", MLP + ["--checkpoint-dir", str(ck), "--save-every", "3"] + steps(9), tmp_path)
    assert_continues(run, baseline(MLP + steps(9)), 3, 9)
    assert sorted(os.listdir(ck)) == ["step-00000003", "step-00000006", "step-00000009"]


# ----------------------------------------------------------------------------- PipeDream-2BW's rule


@pytest.mark.slow
def test_2bw_resumes_in_another_layout_and_in_its_one_process_reference(tmp_path, baseline):
    """2bw on 2 stages -> single_baseline.py --delay 1 -> 2bw on 4 stages, 3 steps each: each takes
    both weight versions and the momentum from the other's checkpoint and logs the uninterrupted
    --delay 1 losses (dropout and clipping on). A resumed 2bw warms up again: the next batch's
    forwards that were in flight are run anew, with the same weights."""
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "3"]
    uninterrupted = baseline(MLP + ["--delay", "1"] + steps(9))
    first = launch("pipeline_microbatch.py", MLP + ck + ["--schedule", "2bw", "--microbatches", "2"] + steps(3),
                   tmp_path, nproc=2, log_name="run.jsonl")
    assert max(abs(a - losses(uninterrupted)[k]) for k, a in losses(first).items()) <= 1e-4
    run = launch("single_baseline.py", MLP + ck + ["--delay", "1"] + steps(6), tmp_path, log_name="run.jsonl")
    assert_continues(run, uninterrupted, 3, 6)
    run = launch("pipeline_microbatch.py", MLP + ck + ["--schedule", "2bw", "--microbatches", "4"] + steps(9),
                 tmp_path, nproc=4, log_name="run.jsonl")
    assert_continues(run, uninterrupted, 6, 9)
    assert run.events("resume")[0]["from"]["program"] == "single_baseline"


def test_2bw_resumed_in_the_same_layout_is_bit_identical(tmp_path):
    args = MLP + ["--schedule", "2bw", "--microbatches", "2"]
    whole = launch("pipeline_microbatch.py", args + steps(6), tmp_path, nproc=2, log_name="whole.jsonl")
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "3"]
    launch("pipeline_microbatch.py", args + ck + steps(3), tmp_path, nproc=2, log_name="split.jsonl")
    resumed = launch("pipeline_microbatch.py", args + ck + steps(6), tmp_path, nproc=2, log_name="split.jsonl")
    assert losses(resumed) == losses(whole)                          # every step, to the bit


@pytest.mark.parametrize("saved,resumed,message", [
    (["--delay", "1"], ("pipeline_microbatch.py", ["--schedule", "1f1b"], 2),
     "PipeDream-2BW's update (--schedule 2bw, single_baseline.py --delay 1) there, the synchronous update here"),
    ([], ("pipeline_microbatch.py", ["--schedule", "2bw", "--microbatches", "2"], 2),
     "the synchronous update there, PipeDream-2BW's update (--schedule 2bw, single_baseline.py --delay 1) here"),
], ids=["2bw-into-1f1b", "sync-into-2bw"])
def test_a_checkpoint_resumes_only_under_its_own_update_rule(tmp_path, saved, resumed, message, monkeypatch, capsys):
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    launch("single_baseline.py", MLP + ck + saved + steps(1), tmp_path)
    program, extra, world = resumed
    module = __import__(program[:-3])
    assert_one_error_line(module.parse_args, MLP + ck + extra + steps(2), world,
                          f"error: the checkpoint {tmp_path / 'ck'}/step-00000001 is of another run ({message})",
                          monkeypatch, capsys)


@pytest.mark.slow
def test_kill_9_of_one_rank_under_max_restarts_resumes_and_finishes(tmp_path, baseline):
    """torchrun --max-restarts 1: one worker is killed with SIGKILL mid-run; the restarted workers
    resume from the last checkpoint (their process group under this attempt's store prefix) and
    finish with the uninterrupted baseline's losses."""
    args = FAST + ["--model", "mlp", "--layers", "4", "--hidden", "256", "--batch-size", "32", "--timeout-s", "30",
                   "--checkpoint-dir", "ck", "--save-every", "10"] + steps(150)
    log = tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "--", os.path.join(ROOT, "pipeline_microbatch.py")] + args + ["--log-file", str(log)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 120
    while max(trained_steps(log), default=-1) < 35:
        assert time.time() < deadline and proc.poll() is None, "the run did not reach step 35"
        time.sleep(0.05)
    worker = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0]
    os.kill(int(worker), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "note: resumed from ck/step-000000" in out
    records = read_log(log)
    got = {r["step"]: r["loss"] for r in records if r["event"] == "train"}
    want = losses(baseline([a for a in args if a not in ("--checkpoint-dir", "ck", "--save-every", "10")]))
    assert sorted(got) == list(range(150)) and max(abs(got[k] - want[k]) for k in got) <= 1e-4


def trained_steps(log):
    """The steps logged so far by a run still writing (its last line may be cut short)."""
    current = newest_log(str(log))     # while it runs, the log is its partial file (mp/log.py)
    if not current:
        return []
    with open(current) as f:
        lines = f.read().splitlines()
    return [json.loads(line)["step"] for line in lines[:-1] if '"train"' in line]


def make_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    run = launch("single_baseline.py", MLP + ["--checkpoint-dir", str(ck), "--save-every", "2"] + steps(2), tmp_path)
    assert run.returncode == 0, run.stderr
    return ck


def listing(directory):
    return sorted((os.path.relpath(os.path.join(d, f), directory), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(directory) for f in files)


@pytest.mark.parametrize("damage,flags,message", [
    (None, ["--hidden", "64"], "is of another run (--hidden 32 there, 64 here)"),
    (None, ["--dropout", "0.2"], "is of another run (--dropout 0.1 there, 0.2 here)"),
    ("truncate", [], "is damaged: __0_0.distcp has 100 bytes, its metadata needs"),
    ("metadata", [], "is damaged: its DCP metadata cannot be read"),
    ("meta.json", [], "is damaged: its meta.json cannot be read"),
])
def test_a_checkpoint_that_cannot_be_loaded_is_one_error_line_and_deletes_nothing(tmp_path, damage, flags, message):
    ck = make_checkpoint(tmp_path)
    step = ck / "step-00000002"
    if damage == "truncate":
        with open(step / "__0_0.distcp", "r+b") as f:
            f.truncate(100)
    elif damage:
        (step / (".metadata" if damage == "metadata" else "meta.json")).write_text("{")
    before = listing(ck)
    run = launch("pipeline_microbatch.py", MLP + ["--checkpoint-dir", str(ck)] + steps(4) + flags, tmp_path, nproc=2)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], run.stderr[-2000:]
    assert not any(f'{ours}", line' in run.stderr for ours in ("checkpoint.py", "dist.py", "flags.py", "pipeline_microbatch.py"))
    assert run.returncode != 0 and run.exited(2), run.stderr[-2000:]
    assert listing(ck) == before


def test_a_checkpoint_dir_that_is_a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("keep me")
    run = launch("single_baseline.py", MLP + ["--checkpoint-dir", str(path)] + steps(2), tmp_path)
    assert run.returncode == 2 and run.stderr.startswith(f"error: --checkpoint-dir {path} is a file"), run.stderr
    assert path.read_text() == "keep me"


def test_meta_records_the_settings_and_the_layout(tmp_path):
    ck = make_checkpoint(tmp_path)
    meta = json.loads((ck / "step-00000002" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["layout"] == {"program": "single_baseline", "world_size": 1}
    assert meta["settings"]["hidden"] == 32 and meta["settings"]["dropout"] == 0.1
    shutil.rmtree(ck)


def test_a_peer_lost_in_a_save_names_the_checkpoint(tmp_path, monkeypatch):
    """A save is collectives (barriers, dcp's plan): a peer lost there ends in one line naming the
    checkpoint (mp.dist.awaiting), not in gloo's bare message; the previous checkpoint stays."""
    from argparse import Namespace
    import torch
    import mp.checkpoint as checkpoint
    from mp.errors import CommError

    monkeypatch.setattr(checkpoint.dist, "barrier", peer_lost)
    (tmp_path / "step-00000001").mkdir()
    args = Namespace(checkpoint_dir=str(tmp_path), timeout_s=7)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CommError) as e:
        checkpoint.save(args, 2, model, torch.optim.SGD(model.parameters(), lr=0.1), {}, rank=0)
    assert str(e.value).startswith(f"rank 0 waited for every rank's part of the checkpoint {tmp_path}/step-00000002, "
                                   "and gave up (timeout 7 s): [../third_party/gloo/"), str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]
