"""Expert parallelism: the program against the baseline step by step (losses, norms, the routing and the
dropped choices), what each rank holds and sends, --check, a resume across layouts, and the bad inputs
refused. One launch serves every assertion about its run."""
import argparse
from functools import partial

import pytest

import expert_parallel as ep
from helpers import FAST, assert_one_error_line, assert_same_losses, launch, slow, written
from test_launchers import launcher as run_launcher
from mp.tools.figure import png_record
from mp.models import build_model, param_mb

# dropout (keyed by the sample's global index) and a clipping norm the gradient exceeds
RUN = FAST + ["--model", "vit", "--hidden", "16", "--heads", "4", "--layers", "2", "--batch-size", "8",
              "--steps", "6", "--dropout", "0.1", "--clip-grad-norm", "0.1", "--log-every", "3"]
HIDDEN, LAYERS, BATCH, TOKENS = 16, 2, 8, 64


def moe_args(argv):
    return ep.parse_args(argv)


def expected_param_mb(experts, nproc):
    """(the baseline's param_mb, each rank's: the replicated weights and E/N experts)."""
    args = argparse.Namespace(model="vit", layers=LAYERS, hidden=HIDDEN, heads=4, patch_size=4, seed=0, dropout=0.0,
                              activation="gelu", experts=experts, top_k=1, capacity_factor=None, aux_loss=0.01)
    model = build_model(args)
    experts_mb = param_mb(p for n, p in model.named_parameters() if ".experts." in n)
    whole = param_mb(model.parameters())
    return whole, whole - experts_mb + experts_mb / nproc


def balanced_all_to_all_mb(nproc, top_k):
    """A rank's all-to-all bytes per step when its choices spread evenly over the ranks: (N-1)/N of its
    B/N x T x K rows leave it in the dispatch, as many come back in the combine, and the backward sends
    both again: 4 x (N-1)/N x B/N x T x K rows of H float32 per block."""
    rows = 4 * (nproc - 1) / nproc * BATCH // nproc * TOKENS * top_k
    return LAYERS * rows * HIDDEN * 4 / 2**20


@pytest.mark.parametrize("nproc,experts,top_k,capacity", [
    (2, 2, 2, None),         # every token to both experts: the all-to-all's bytes are exactly the formula's
    (2, 4, 1, 1.0),
    slow(2, 4, 2, None), slow(4, 8, 1, None), slow(4, 8, 2, 1.25), slow(4, 4, 2, 1.0), slow(2, 8, 1, None)])
def test_program_logs_the_baseline_losses_norms_and_routing(tmp_path, baseline, nproc, experts, top_k, capacity):
    args = RUN + ["--experts", str(experts), "--top-k", str(top_k)]
    args += ["--capacity-factor", str(capacity)] if capacity else []
    run = launch("expert_parallel.py", args, tmp_path, nproc=nproc)
    reference = baseline(args)
    worst = assert_same_losses(run, reference)
    norms = [(r["grad_norm"], w["grad_norm"]) for r, w in zip(run.events("train"), reference.events("train"))]
    assert max(abs(a - b) for a, b in norms) <= 1e-4, norms
    assert sum(b > 0.1 for _, b in norms) >= len(norms) // 2, f"clipping was not active: {norms}"
    summary, ref = run.events("summary")[0], reference.events("summary")[0]
    # the same tokens routed to the same experts, and the same choices dropped over capacity
    assert summary["tokens_per_expert"] == ref["tokens_per_expert"]
    assert summary["dropped_per_step"] == ref["dropped_per_step"]
    assert any(summary["dropped_per_step"]) == (capacity is not None), summary["dropped_per_step"]
    whole, mine = expected_param_mb(experts, nproc)
    assert ref["param_mb"] == {"0": round(whole, 4)}
    assert summary["param_mb"] == {str(r): round(mine, 4) for r in range(nproc)}, (summary["param_mb"], mine)
    sent, balanced = summary["all_to_all_mb_per_step"], balanced_all_to_all_mb(nproc, top_k)
    if top_k == experts == nproc and capacity is None:
        assert all(abs(v - balanced) < 1e-5 for v in sent.values()), (sent, balanced)
    assert 0 < sum(sent.values()) <= nproc * balanced * nproc / (nproc - 1) + 1e-5, (sent, balanced)
    assert f"replicated weights bit-identical across the {nproc} expert-parallel ranks: yes" in run.stdout
    print(f"ep {nproc}, E {experts}, K {top_k}, C {capacity}: largest |loss difference| {worst:.2g}; param_mb "
          f"{mine:.4f} a rank (baseline {whole:.4f}); all-to-all MB/step {sent} (balanced {balanced:.4f})")


@pytest.mark.parametrize("nproc,extra", [(4, ["--experts", "8", "--top-k", "2", "--capacity-factor", "1.0"]),
                                         slow(2, ["--experts", "4"])])
def test_check_flag_matches(tmp_path, nproc, extra):
    run = launch("expert_parallel.py", RUN + extra + ["--check"], tmp_path, nproc=nproc)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert f"on {nproc} ranks" in run.stdout and "all tensors match the full model" in run.stdout, run.stdout


@pytest.mark.slow
def test_resume_across_layouts_continues_the_baseline(tmp_path, baseline):
    """One process -> 2 ranks -> 4 ranks -> one process, three steps each, through one checkpoint
    directory (the experts saved by name, as the baseline names them): the uninterrupted baseline's losses."""
    args = RUN + ["--experts", "8", "--top-k", "2", "--capacity-factor", "1.25", "--save-every", "3"]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    whole = baseline([a if a != "6" else "12" for a in args])
    losses = []
    for steps, program, nproc in ((3, "single_baseline.py", 1), (6, "expert_parallel.py", 2),
                                  (9, "expert_parallel.py", 4), (12, "single_baseline.py", 1)):
        part = [a if a != "6" else str(steps) for a in args] + ckpt
        run = launch(program, part, tmp_path, nproc=nproc, log_name=f"part{steps}.jsonl")
        assert run.returncode == 0, run.stderr[-2000:]
        assert [r["step"] for r in run.events("train")] == list(range(steps - 3, steps))
        losses += run.losses()
    worst = max(abs(a - b) for a, b in zip(losses, whole.losses()))
    assert len(losses) == 12 and worst <= 1e-4, worst


@pytest.mark.parametrize("argv,world,message", [
    (["--experts", "6"], 4, "error: --experts 6 is not divisible by the 4 ranks; every rank holds E/N whole experts: "
                            "use --experts 4 or 3 ranks (torchrun --nproc-per-node 3) or 6 ranks"),
    (["--experts", "2", "--top-k", "2", "--capacity-factor", "-1"], 2,
     "error: --capacity-factor -1.0 must be a finite number > 0"),
    (["--experts", "1", "--top-k", "2"], 1, "error: --top-k 2 is more than --experts 1"),
    (["--top-k", "3"], 2, "error: argument --top-k: invalid choice: 3"),
    (["--model", "cnn"], 2, "error: expert_parallel.py trains the vit or the gpt, whose feed-forward blocks "
                            "become the experts, and --model cnn has none: drop --model, or use --model vit or gpt"),
    (["--model", "mlp", "--experts", "4"], 2, "error: --model mlp does not use --experts"),
    (["--experts", "0"], 2, "error: --experts 0: expert parallelism needs a mixture of experts; use --experts 2"),
    (["--batch-size", "6"], 4, "error: --batch-size 6 is not divisible by the 4 ranks"),
])
def test_bad_input_is_one_error_line_and_exit_2(monkeypatch, capsys, argv, world, message):
    assert_one_error_line(moe_args, ["--data", "synthetic"] + argv, world, message, monkeypatch, capsys)


def test_bad_input_under_torchrun_fails_on_every_rank_before_any_collective(tmp_path):
    run = launch("expert_parallel.py", ["--data", "synthetic", "--experts", "3"], tmp_path, nproc=2, timeout=60)
    assert run.returncode != 0 and run.exited(2)
    assert run.stderr.count("error: --experts 3 is not divisible by the 2 ranks") == 1, run.stderr
    assert 'expert_parallel.py", line' not in run.stderr


# ----------------------------------------------------------------------------- run_ep.sh


launcher = partial(run_launcher, "run_ep.sh")   # test_launchers.py's: LOGS under tmp_path, synthetic data


@pytest.mark.slow
def test_run_ep_draws_the_run_on_the_baseline_with_the_load(tmp_path):
    run = launcher(tmp_path, ["--hidden", "16", "--layers", "1"], STEPS="3", TOP_K="2", CAPACITY="1.0")
    assert run.returncode == 0, run.stderr[-2000:]
    logs, tag = tmp_path / "logs", "_hidden16_layers1_steps3_synthetic_evalevery0"
    assert written(run.stdout) == [f"{logs}/single_baseline_vit_e4_k2_c1.0{tag}_b64.jsonl",
                                   f"{logs}/expert_parallel_vit_e4_k2_c1.0{tag}_ep2_b64.jsonl",
                                   f"{logs}/plots/ep_loss_topk2_capacity1.0{tag}.png"], run.stdout
    _, record = png_record(str(logs / "plots" / f"ep_loss_topk2_capacity1.0{tag}.png"))
    assert [r["program"] for r in record["runs"]] == ["single_baseline", "expert_parallel"], record
    assert record["runs"][1]["largest_difference"] <= 1e-4
    assert record["expert_load"] == {"drawn": record["runs"][0]["label"], "same_in": [record["runs"][1]["label"]],
                                     "first_differs": {}}
    assert "largest |loss - baseline|" in run.stdout


def test_run_ep_refuses_bad_knobs_in_its_terms_before_anything_trains(tmp_path):
    run = launcher(tmp_path, NPROC="4", EXPERTS="6")
    assert run.returncode == 2 and run.stderr.splitlines() == [
        "error: EXPERTS=6 is not divisible by the 4 ranks; every rank holds E/N whole experts: use EXPERTS=4 or "
        "3 ranks (NPROC=3) or 6 ranks (NPROC=6)"], run.stderr
    run = launcher(tmp_path, TOP_K="3")
    assert run.returncode == 2 and run.stderr.splitlines() == ["error: TOP_K=3 must be one of: 1 2"]
    run = launcher(tmp_path, ["--experts", "8"])
    assert run.returncode == 2 and "use EXPERTS=8 bash run_ep.sh" in run.stderr, run.stderr
    run = launcher(tmp_path, CHECK_ONLY="1", CAPACITY="1.25", TOP_K="2")
    assert run.returncode == 0 and run.stdout.startswith("CHECK_ONLY=1: "), run.stderr
    assert not (tmp_path / "logs").exists()
