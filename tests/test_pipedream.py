"""PipeDream-2BW: the schedule as data across step boundaries, the --delay 1 reference against a
hand-computed example, --schedule 2bw against that reference on real runs, and its bad input."""
import os
import subprocess

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parallel_3d
import pipeline_microbatch as pm
import single_baseline
from helpers import FAST, PYTHON, ROOT, Run, assert_one_error_line, assert_same_losses, launch, read_log, written
from mp.dropout import DropoutKeys
from mp.pp.schedules import clock_table, dry_run, pipedream_units, schedule_actions


def names(units):
    return " ".join(f"{kind}{mb}" for unit in units for kind, mb, _ in unit)


def test_2bw_steps_are_1f1b_run_straight_through():
    """p=3, m=3. Stage r warms up only in the first step, drains only in the last, and in between
    runs m (forward, backward) pairs whose last p-r-1 forwards (numbered from m) are the next batch's."""
    assert [names(pipedream_units(3, 3, r, last=False)) for r in range(3)] == [
        "F0 F1 F2 B0 F3 B1 F4 B2",
        "F0 F1 B0 F2 B1 F3 B2",
        "F0 B0 F1 B1 F2 B2"]
    assert [names(pipedream_units(3, 3, r, first=False, last=False)) for r in range(3)] == [
        "F2 B0 F3 B1 F4 B2",
        "F1 B0 F2 B1 F3 B2",
        "F0 B0 F1 B1 F2 B2"]
    assert [names(pipedream_units(3, 3, r, first=False)) for r in range(3)] == [
        "F2 B0 B1 B2",
        "F1 B0 F2 B1 B2",
        "F0 B0 F1 B1 F2 B2"]
    # a single step (first and last) is 1F1B itself
    assert [names(pipedream_units(3, 3, r)) for r in range(3)] == [
        "F0 F1 F2 B0 B1 B2", "F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]


def test_the_clock_table_shows_no_flush_between_two_steps():
    """Batch 1 (microbatches 3-5) starts on stage 0 while batch 0's backwards still drain."""
    assert clock_table("2bw", 3, 3) == [
        "stage 0: F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5",
        "stage 1: .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5",
        "stage 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"]


def runs_of(p, m, steps):
    ranks = [pm.PipelineRank(r, p, list(range(p))) for r in range(p)]
    return [[schedule_actions("2bw", pos, m, first=t == 0, last=t == steps - 1) for t in range(steps)] for pos in ranks]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_2bw_is_deadlock_free_and_every_step_receives_what_it_sends(p):
    """Played with blocking sends over whole runs, and step by step: every message sent in a step
    is received in the same step, so nothing is left in flight across the optimizer step, the
    gradient-norm collective or an evaluation."""
    for m in range(p, p + 4):
        for steps in (1, 2, 3, 6):
            runs = runs_of(p, m, steps)
            assert dry_run([[a for step in run for a in step] for run in runs]) is None, (p, m, steps)
            for t in range(steps):
                assert dry_run([run[t] for run in runs]) is None, (p, m, steps, t)


def test_the_deadlock_check_sees_a_receive_left_for_the_next_step():
    """Without the early receive, the next step's first message would cross the boundary: the
    step played alone then blocks (the check can fail)."""
    runs = runs_of(3, 3, 3)
    middle = [run[1] for run in runs]
    middle[2] = middle[2][:-1]                  # the last stage drops its final exchange
    assert dry_run(middle) is not None


# ----------------------------------------------------------------------------- the reference


class Tiny(nn.Module):
    """Two classes, logits = W x: small enough to differentiate by hand."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[0.5, -0.25], [0.0, 0.75]]))
        self.dropout_keys = DropoutKeys(seed=0)

    def forward(self, x):
        return self.linear(x)


def hand_gradient(W, x, y):
    """d mean CE / dW = (softmax(W x) - onehot(y))^T x / n, no autograd."""
    p = torch.softmax(x @ W.t(), dim=1)
    return (p - F.one_hot(y, 2).float()).t() @ x / len(y)


def test_the_delay_1_reference_against_a_hand_computed_two_step_example():
    """W(t+1) = W(t) - lr * buf(t), buf(t) = mu buf(t-1) + grad f_t(W(t-1)), W(-1) = W(0): both
    steps take their gradient at the initial weights, and the loss logged at step 1 is batch 1's
    loss at W(0)."""
    import copy
    lr, mu = 0.1, 0.9
    model = Tiny()
    stale = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mu)
    batches = [(torch.tensor([[1.0, 2.0], [0.5, -1.0]]), torch.tensor([0, 1])),
               (torch.tensor([[-1.0, 0.5], [2.0, 1.0]]), torch.tensor([1, 1]))]
    W0 = model.linear.weight.detach().clone()
    losses = [single_baseline.delayed_train_step(model, stale, opt, x, y, F.cross_entropy, t)[0]
              for t, (x, y) in enumerate(batches)]
    g0, g1 = (hand_gradient(W0, x, y) for x, y in batches)
    W1 = W0 - lr * g0
    W2 = W1 - lr * (mu * g0 + g1)
    torch.testing.assert_close(model.linear.weight.detach(), W2)
    assert losses[1] == pytest.approx(F.cross_entropy(batches[1][0] @ W0.t(), batches[1][1]).item(), abs=1e-7)
    torch.testing.assert_close(stale.linear.weight.detach(), W1)      # the next step's gradient point
    # without the delay the second gradient is taken at W1: a different result (the test can fail)
    assert not torch.allclose(W2, W1 - lr * (mu * g0 + hand_gradient(W1, *batches[1])))


# ----------------------------------------------------------------------------- real runs


@pytest.mark.slow
@pytest.mark.parametrize("model,stages,m,extra,ours", [
    ("mlp", 2, 2, ["--hidden", "32", "--layers", "4"], []),                         # m = p
    ("mlp", 3, 5, ["--hidden", "32", "--layers", "6", "--dropout", "0.2"],         # m > p, keyed dropout across
     ["--recompute"]),                                                              # steps, recomputed forwards
    ("cnn", 4, 4, ["--eval-every", "4"], []),                                       # evaluation between steps
    ("vit", 2, 3, ["--hidden", "16", "--layers", "4", "--heads", "2", "--clip-grad-norm", "0.5"], []),
])
def test_2bw_logs_its_reference_losses(tmp_path, baseline, model, stages, m, extra, ours):
    args = ["--data", "synthetic", "--model", model, "--steps", "8", "--batch-size", str(6 * m), "--lr", "0.05"] + extra
    run = launch("pipeline_microbatch.py", args + ours + ["--schedule", "2bw", "--microbatches", str(m)], tmp_path,
                 nproc=stages)
    reference = launch("single_baseline.py", args + ["--delay", "1"], tmp_path, log_name="delay.jsonl")
    assert_same_losses(run, reference)
    synchronous = baseline(args)                 # staleness changes the run: the comparison has teeth
    assert max(abs(a - b) for a, b in zip(reference.losses(), synchronous.losses())) > 1e-4
    if "--eval-every" in extra:
        for got, want in zip(run.events("eval"), reference.events("eval"), strict=True):
            assert abs(got["test_loss"] - want["test_loss"]) < 1e-4
    summary = run.events("summary")[0]
    assert summary["schedule"] == "2bw" and len(summary["param_mb"]) == stages


def test_2bw_holds_two_weight_versions(tmp_path):
    """The summary's per-rank parameter memory counts both versions: twice a stage's weights."""
    args = FAST + ["--model", "mlp", "--hidden", "32", "--layers", "4", "--batch-size", "8", "--steps", "3"]
    one = launch("pipeline_microbatch.py", args + ["--schedule", "1f1b"], tmp_path, nproc=2, log_name="1f1b.jsonl")
    two = launch("pipeline_microbatch.py", args + ["--schedule", "2bw"], tmp_path, nproc=2, log_name="2bw.jsonl")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    mb1, mb2 = (run.events("summary")[0]["param_mb"] for run in (one, two))
    assert mb1.keys() == mb2.keys()
    for rank in mb1:
        assert mb2[rank] == pytest.approx(2 * mb1[rank], abs=2e-4)   # logged to 4 decimals


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv,world,message", [
    (["--schedule", "2bw", "--microbatches", "2"], 4,
     "error: --schedule 2bw needs --microbatches at least the 4 stages"),
    (["--schedule", "2bw", "--virtual-stages", "2"], 2, "error: --virtual-stages 2 applies only to --schedule interleaved"),
    (["--schedule", "2bw", "--check"], 2, "error: --schedule 2bw does not take --check"),
])
def test_2bw_bad_input_is_one_error_line(argv, world, message, monkeypatch, capsys):
    assert_one_error_line(pm.parse_args, FAST + argv, world, message, monkeypatch, capsys)


def test_2bw_is_refused_by_the_3d_program(monkeypatch, capsys):
    assert_one_error_line(parallel_3d.parse_args, FAST + ["--schedule", "2bw", "--dp", "1", "--tp", "2"], 4,
                          "error: --schedule 2bw runs in pipeline_microbatch.py and pipeline_dp_joint.py, not "
                          "parallel_3d.py", monkeypatch, capsys)


def test_2bw_in_the_joint_launcher_logs_its_delay_1_reference(tmp_path):
    """run_joint.sh SCHEDULE=2bw: 2 pipelines of 2 stages, each running 2bw on its slice of the batch
    (dropout and clipping on), against the baseline it then runs with --delay 1."""
    env = dict(os.environ, PYTHON=PYTHON, LOGS=str(tmp_path / "logs"), DATA="synthetic", EVAL_EVERY="0",
               OMP_NUM_THREADS="1", SCHEDULE="2bw", DP="2", NPROC="4", MICROBATCHES="2", MODEL="mlp", STEPS="6",
               BATCH_SIZE="24", DROPOUT="0.1", CLIP="0.5")
    run = subprocess.run(["bash", os.path.join(ROOT, "run_joint.sh"), "--hidden", "32", "--layers", "4"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "== baseline with --delay 1, the 2bw reference: one process" in run.stdout
    logs = sorted((tmp_path / "logs").glob("*.jsonl"))
    (reference_log,), (joint_log,) = [[p for p in logs if p.name.startswith(prefix)]
                                      for prefix in ("single_baseline", "pipeline_dp_joint")]
    reference, joint = (Run(0, "", "", read_log(p)) for p in (reference_log, joint_log))
    assert reference_log.name.endswith("_delay1.jsonl") and reference.events("config")[0]["args"]["delay"] == 1
    assert joint.events("config")[0]["args"]["schedule"] == "2bw"
    assert_same_losses(joint, reference)
    assert "parameters bit-identical across the 2 replicas of every stage: yes" in run.stdout
    png, = [path for path in written(run.stdout) if path.endswith(".png")]   # apart from a synchronous run's
    assert os.path.basename(png).startswith("joint_loss_mlp_nproc4_microbatches2_2bw_batchsize24_") and os.path.getsize(png) > 10_000


@pytest.mark.parametrize("argv,message", [
    (["--delay", "2"], "error: argument --delay: invalid choice: 2"),
])
def test_delay_bad_input(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exit_:
        single_baseline.parse_args(FAST + argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
