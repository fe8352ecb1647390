"""AdamW (mp/optim.py) in every program: the baseline's losses step for step, its weights and state
after 20 steps in the checkpoint's baseline coordinates, a resume in another layout that needs the
saved state, and the flags' refusals."""
import json
import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

import single_baseline
from helpers import FAST, assert_one_error_line, assert_same_losses, launch, slow
from mp import checkpoint, optim
from mp.tools import knobs

STEPS = 20
ADAMW = FAST + ["--model", "mlp", "--layers", "4", "--hidden", "32", "--batch-size", "16", "--optimizer", "adamw",
                "--weight-decay", "0.01", "--dropout", "0.1", "--clip-grad-norm", "0.5", "--steps", str(STEPS)]
LAYOUTS = {   # program, its layout flags, ranks
    "pipeline-1f1b": ("pipeline_microbatch.py", ["--schedule", "1f1b", "--microbatches", "2"], 2),
    "joint-dp2": ("pipeline_dp_joint.py", ["--dp", "2", "--microbatches", "2"], 4),
    "tp2": ("tensor_parallel.py", [], 2),
    "3d-dp2-tp2": ("parallel_3d.py", ["--dp", "2", "--tp", "2", "--microbatches", "2"], 4),
    "3d-dp2-pp2-tp2": ("parallel_3d.py", ["--dp", "2", "--tp", "2", "--microbatches", "2"], 8),
}


def saved_run(program, extra, nproc, directory, save_every=STEPS):
    """Launch with checkpoints every save_every steps under directory/ck; returns the Run."""
    ck = ["--checkpoint-dir", str(directory / "ck"), "--save-every", str(save_every)]
    return launch(program, ADAMW + extra + ck, directory, nproc=nproc, log_name="run.jsonl")


def full_tensors(step_dir, scratch):
    """{key without its slice: the full tensor} of a DCP checkpoint: the slices of a tensor (the
    @dim:start:length of their keys, and --zero's flat #first:count:shape ranges) put back together, as
    the baseline would have saved it."""
    dcp_to_torch_save(str(step_dir), str(scratch))
    pieces, tensors = {}, torch.load(scratch, weights_only=True)
    for k in tensors:
        kind, name, spec, flat = checkpoint.parse_key(k)
        pieces.setdefault(f"{kind}/{name}", []).append((spec, k, None, None, flat))
    out = {}
    for k, parts in pieces.items():
        parts = checkpoint.joined(parts, tensors)
        if parts[0][0] is None:
            out[k] = parts[0][1]
        else:
            dim = parts[0][0][0]
            out[k] = torch.cat([t for _, t in sorted(parts, key=lambda part: part[0][1])], dim=dim)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """single_baseline.py with the same flags, checkpointing after steps 10 and 20: (Run, its directory)."""
    directory = tmp_path_factory.mktemp("adamw-baseline")
    run = saved_run("single_baseline.py", [], 1, directory, save_every=STEPS // 2)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, directory


def assert_same_state(got, want):
    """The weights: all but 1 in 10,000 within 1e-6, and none beyond 1e-4. AdamW moves an element by
    about lr (1e-3) whatever its gradient's size, so an element whose gradient is at the rounding level
    of its sum over the batch (|g| ~ 1e-10: the sign depends on the summation order, which every layout
    changes) takes a step the baseline did not. Measured 2026-11-25: 1 to 3 of 100,778 weights beyond
    1e-6 in each layout, the largest 1.35e-5 (tp2); all the others within 1e-6. The running means
    (exp_avg, exp_avg_sq): within 0.1% of each tensor's largest value; the step counts: equal."""
    assert sorted(got) == sorted(want)
    assert {k.split("/")[0] for k in got} == {"param", "exp_avg", "exp_avg_sq", "step"}
    params = [k for k in want if k.startswith("param/")]
    far = {k: (got[k] - want[k]).abs() for k in params}
    assert max(d.max().item() for d in far.values()) <= 1e-4, {k: d.max().item() for k, d in far.items()}
    outside = sum((d > 1e-6).sum().item() for d in far.values())
    assert outside <= sum(d.numel() for d in far.values()) // 10_000, f"{outside} weights differ by more than 1e-6"
    for k in want:
        if k.startswith(("exp_avg/", "exp_avg_sq/")):
            atol = 1e-3 * want[k].abs().max().item()
            torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        elif k.startswith("step/"):
            assert float(got[k]) == float(want[k]) == STEPS, k


@pytest.mark.parametrize("layout", [layout if layout in ("tp2", "3d-dp2-tp2") else slow(layout) for layout in LAYOUTS])
def test_adamw_matches_the_baseline_losses_weights_and_state(layout, reference, tmp_path):
    """Per-step losses within 1e-4 of the baseline's, and after 20 steps every weight and every piece
    of AdamW's state as the baseline's (assert_same_state), key by key in the baseline's coordinates."""
    program, extra, nproc = LAYOUTS[layout]
    run = saved_run(program, extra, nproc, tmp_path)
    assert_same_losses(run, reference[0])
    want = full_tensors(reference[1] / "ck" / f"step-{STEPS:08d}", tmp_path / "baseline.pt")
    assert_same_state(full_tensors(tmp_path / "ck" / f"step-{STEPS:08d}", tmp_path / "run.pt"), want)


def test_a_tensor_parallel_adamw_checkpoint_resumes_in_a_pipeline(reference, tmp_path):
    """tensor_parallel.py saves after step 10; pipeline_microbatch.py resumes and logs the uninterrupted
    baseline's losses for steps 10..19. The same checkpoint without its optimizer state (rewritten
    through torch_save_to_dcp) resumes too, and its losses leave the baseline's: the state matters."""
    baseline_run, _ = reference
    want = {r["step"]: r["loss"] for r in baseline_run.events("train")}
    first = saved_run("tensor_parallel.py", [], 2, tmp_path, save_every=STEPS // 2)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(tmp_path / "ck" / f"step-{STEPS:08d}")     # resume from step 10
    resumed = saved_run("pipeline_microbatch.py", LAYOUTS["pipeline-1f1b"][1], 2, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.events("resume")[0]["step"] == STEPS // 2
    assert resumed.events("resume")[0]["from"]["program"] == "tensor_parallel"
    got = {r["step"]: r["loss"] for r in resumed.events("train")}
    assert max(abs(got[k] - want[k]) for k in range(STEPS // 2, STEPS)) <= 1e-4

    stateless = tmp_path / "stateless"                        # the parameters only, under the same meta.json
    step_dir = tmp_path / "ck" / f"step-{STEPS // 2:08d}"
    dcp_to_torch_save(str(step_dir), str(tmp_path / "all.pt"))
    params = {k: t for k, t in torch.load(tmp_path / "all.pt", weights_only=True).items() if k.startswith("param/")}
    torch.save(params, tmp_path / "params.pt")
    torch_save_to_dcp(str(tmp_path / "params.pt"), str(stateless / step_dir.name))
    shutil.copy(step_dir / "meta.json", stateless / step_dir.name / "meta.json")
    dropped = launch("single_baseline.py", ADAMW + ["--checkpoint-dir", str(stateless)], tmp_path,
                     log_name="dropped.jsonl")
    assert dropped.returncode == 0, dropped.stderr[-3000:]
    lost = {r["step"]: r["loss"] for r in dropped.events("train")}
    assert sorted(lost) == list(range(STEPS // 2, STEPS))
    assert max(abs(lost[k] - want[k]) for k in lost) > 1e-3       # ten times the contract's tolerance


@pytest.mark.parametrize("argv,message", [
    (["--zero", "1"], "error: --zero 1: single_baseline.py has no data-parallel axis to split the optimizer state "
                      "over; drop --zero, or run pipeline_dp_joint.py or parallel_3d.py"),
    (["--optimizer", "adamw", "--beta1", "1.5"], "error: --beta1 1.5 must be in [0, 1)"),
    (["--optimizer", "adam"], "error: argument --optimizer: invalid choice: 'adam'"),
    (["--adam-eps", "0"], "error: --adam-eps 0.0 must be a finite number > 0"),
    (["--weight-decay", "-0.1"], "error: --weight-decay -0.1 must be a finite number >= 0"),
    (["--log-every", "0"], "error: --log-every 0 must be a positive integer"),
], ids=["zero-without-dp", "beta1", "adam", "eps", "decay", "log-every"])
def test_bad_optimizer_flags_are_one_error_line(argv, message, monkeypatch, capsys):
    assert_one_error_line(single_baseline.parse_args, FAST + argv, 1, message, monkeypatch, capsys)


def test_an_adamw_checkpoint_resumed_as_sgd_is_one_error_line(reference, monkeypatch, capsys):
    ck = reference[1] / "ck"
    sgd = [a for a in ADAMW if a not in ("--optimizer", "adamw")] + ["--checkpoint-dir", str(ck)]
    assert_one_error_line(single_baseline.parse_args, sgd, 1,
                          f"error: the checkpoint {ck}/step-{STEPS:08d} is of another run (--optimizer adamw there, "
                          f"sgd here; --lr 0.001 there, 0.02 here)", monkeypatch, capsys)


def test_the_lr_default_follows_the_optimizer_and_the_state_size(monkeypatch):
    """--lr's default per optimizer; AdamW's state is twice SGD's momentum (plus one 0-dim step per
    parameter), and the interface goes through an optimizer's own methods where it has them."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sgd_args = single_baseline.parse_args(FAST)
    adamw_args = single_baseline.parse_args(FAST + ["--optimizer", "adamw"])
    assert (sgd_args.lr, adamw_args.lr) == (0.02, 1e-3)
    model = torch.nn.Linear(256, 256)
    sizes = {}
    for args in (sgd_args, adamw_args):
        opt = optim.make_optimizer(model.parameters(), args)
        assert optim.optimizer_state_mb(opt) == 0
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
        sizes[args.optimizer] = optim.optimizer_state_mb(opt)
        kinds = optim.param_state(opt, model.weight)
        assert all(t.shape == model.weight.shape for k, t in kinds.items() if k != "step")
        fresh = optim.make_optimizer(model.parameters(), args)
        optim.load_param_state(fresh, model.weight, kinds)
        assert optim.param_state(fresh, model.weight).keys() == kinds.keys()
    param_mb = (256 * 256 + 256) * 4 / 2**20
    assert sizes["sgd"] == param_mb and sizes["adamw"] == 2 * param_mb + 2 * 4 / 2**20
    assert sorted(optim.param_state(opt, model.weight)) == ["exp_avg", "exp_avg_sq", "step"]

    class Wrapper:        # what a ZeRO-1 wrapper defines: the functions call it, not optimizer.state
        state = {}

        def param_state(self, p):
            return {"exp_avg": torch.zeros(1)}

        def load_param_state(self, p, state):
            self.loaded = state

        def state_mb(self):
            return 7.0

    wrapper = Wrapper()
    optim.load_param_state(wrapper, model.weight, {"exp_avg": torch.ones(1)})
    assert list(optim.param_state(wrapper, model.weight)) == ["exp_avg"] and wrapper.loaded["exp_avg"].item() == 1
    assert optim.optimizer_state_mb(wrapper) == 7.0


def test_a_checkpoint_from_before_the_optimizer_flags_resumes_as_sgd(tmp_path):
    """meta.json without optimizer, weight_decay, beta1, beta2, adam_eps: SGD without decay, as it was."""
    sgd = [a for a in ADAMW if a not in ("--optimizer", "adamw", "--weight-decay", "0.01")]
    ck = tmp_path / "ck"
    launch("single_baseline.py", sgd + ["--steps", "2", "--checkpoint-dir", str(ck)], tmp_path, log_name="old.jsonl")
    meta_path = ck / "step-00000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for name in ("optimizer", "weight_decay", "beta1", "beta2", "adam_eps"):
        del meta["settings"][name]
    meta_path.write_text(json.dumps(meta))
    whole = launch("single_baseline.py", sgd + ["--steps", "4"], tmp_path, log_name="whole.jsonl")
    resumed = launch("single_baseline.py", sgd + ["--steps", "4", "--checkpoint-dir", str(ck)], tmp_path,
                     log_name="old.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.losses() == whole.losses()
    assert os.path.exists(ck / "step-00000004")


def test_the_launchers_read_optimizer_everywhere_and_zero_where_there_are_replicas():
    """mp.tools.knobs reads the knobs from the scripts: OPTIMIZER from shared_knobs (run_slurm.sh: its
    own line), ZERO from the two launchers whose parallel program has a data-parallel axis and from
    run_slurm.sh, which passes it to those two programs only (test_slurm checks its refusal)."""
    launchers = ["run_pipeline.sh", "run_joint.sh", "run_tp.sh", "run_3d.sh", "run_slurm.sh"]
    read = {name: knobs.knobs_of(os.path.join(knobs.ROOT, name)) for name in launchers}
    assert all("OPTIMIZER" in read[name] for name in launchers)
    assert [name for name in launchers if "ZERO" in read[name]] == ["run_joint.sh", "run_3d.sh", "run_slurm.sh"]
