"""parallel_5d.py against single_baseline.py --microbatches M, step by step (loss and gradient norm within
1e-6, the same tokens routed and dropped), each pitfall of issue 64 put back by tests/broken_5d.py and
caught, and the bad inputs refused before any collective."""
import glob
import json

import pytest

import parallel_5d as p5
from helpers import FAST, assert_one_error_line, flags_id, launch, slow

# dropout 0.1, clipping 0.5 (active: the norms exceed it), AdamW
RUN = FAST + ["--model", "vit", "--hidden", "16", "--heads", "4", "--layers", "2", "--batch-size", "8",
              "--dropout", "0.1", "--clip-grad-norm", "0.5", "--optimizer", "adamw"]
MOE = ["--experts", "4", "--top-k", "2", "--microbatches", "2"]
CAPACITY = MOE + ["--capacity-factor", "1.0"]


def compare(tmp_path, baseline, nproc, layout, model, steps=4, program="parallel_5d.py"):
    """(the 5-D run, the largest |loss - baseline| and |norm - baseline| over the steps)."""
    args = RUN + ["--steps", str(steps)] + model
    run = launch(program, args + layout, tmp_path, nproc=nproc)
    reference = baseline(args)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = run.events("train"), reference.events("train")
    assert len(got) == len(want) == steps
    loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want))
    norm = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, want))
    return run, reference, loss, norm


def assert_exact(tmp_path, baseline, nproc, layout, model, steps=4):
    run, reference, loss, norm = compare(tmp_path, baseline, nproc, layout, model, steps)
    print(f"{nproc} ranks {' '.join(layout)} {' '.join(model)}: loss {loss:.2g}, norm {norm:.2g}")   # pytest -s
    assert loss <= 1e-6 and norm <= 1e-6, f"largest difference: loss {loss:.3g}, grad norm {norm:.3g}"
    assert all(e["grad_norm"] > 0.5 for e in reference.events("train")), "clipping was not active"
    if "--experts" in model:   # the same tokens routed to the same experts, the same choices dropped, every block
        summary, ref = run.events("summary")[0], reference.events("summary")[0]    # (every stage's: mp/ep/routing.py)
        assert summary["tokens_per_expert"] == ref["tokens_per_expert"]
        assert summary["dropped_per_step"] == ref["dropped_per_step"]
        assert any(summary["dropped_per_step"]) == ("--capacity-factor" in model)
    return run


@pytest.mark.parametrize("nproc,layout,model,steps", [
    # pp 2 x cp 2, ep 2 over the cp ranks: the capacity's order interleaves the cp ranks' token chunks
    (4, ["--cp", "2", "--ep", "2"], CAPACITY, 4),
    (4, ["--dp", "2", "--cp", "2", "--ep", "2"], CAPACITY, 4),   # edp 2 x ep 2: every edp rank's experts / N
    slow(4, ["--tp", "2", "--cp", "2", "--attention", "ulysses"], [], 4),        # Ulysses on 4 / (tp 2) heads
    slow(4, ["--tp", "2", "--cp", "2"], MOE, 4),                                 # the ring on my tp heads
    slow(4, ["--dp", "2", "--tp", "2", "--sequence-parallel", "--ep", "2"], CAPACITY, 4),
    slow(4, ["--tp", "2", "--cp", "2", "--sequence-parallel"], CAPACITY, 4),      # tokens split over cp, then tp
    slow(4, ["--tp", "2", "--cp", "2", "--sequence-parallel", "--attention", "ulysses"], [], 4),
    slow(4, ["--dp", "2", "--cp", "2", "--ep", "4"], CAPACITY, 4),
    slow(4, ["--dp", "2", "--tp", "2", "--ep", "4"], CAPACITY, 4),             # ep folded over tp too
    # the 8-rank configurations
    slow(8, ["--cp", "2", "--tp", "2", "--ep", "2"], MOE, 6),
    slow(8, ["--dp", "2", "--tp", "2", "--sequence-parallel", "--ep", "2", "--zero", "2"], MOE, 6),
    slow(8, ["--dp", "2", "--cp", "2", "--ep", "4", "--zero", "3"], CAPACITY, 6),
    # the zero-bubble schedules (the experts' weight gradients in W actions of their own)
    slow(4, ["--cp", "2", "--ep", "2", "--schedule", "zb"], CAPACITY, 4),
    # several buckets a group at 2 KB a bucket, a weight above it alone (qkv 16 x 48, an expert's 16 x 64; issue
    # 82: zb's W wrote the experts' weight gradients past their buckets, which stepped on zeros), every --zero
    (4, ["--dp", "2", "--ep", "2", "--schedule", "zbv", "--zero", "2", "--bucket-mb", "0.002"], MOE, 3),
    slow(4, ["--dp", "2", "--ep", "2", "--schedule", "interleaved", "--zero", "3", "--bucket-mb", "0.002"], MOE, 3),
    slow(4, ["--dp", "2", "--cp", "2", "--ep", "4", "--schedule", "1f1b", "--zero", "2", "--bucket-mb", "0.002"],
         CAPACITY, 3),
    # ZeRO: the dense weights over dp x cp, the experts over edp
    slow(4, ["--dp", "2", "--cp", "2", "--ep", "2", "--zero", "1"], MOE, 4),
    slow(4, ["--dp", "2", "--cp", "2", "--ep", "2", "--zero", "3"], CAPACITY, 4),
    slow(4, ["--dp", "2", "--cp", "2", "--zero", "1"], ["--microbatches", "2"], 4),
    slow(4, ["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero", "2"], ["--microbatches", "2"], 4),
    slow(4, ["--cp", "2", "--tp", "2", "--recompute"], ["--microbatches", "2"], 4),
    # each microbatch routed twice (its backward's forward again): the load and the logged loss counted once
    slow(4, ["--cp", "2", "--ep", "2", "--recompute"], CAPACITY, 4),
    slow(8, ["--dp", "2", "--cp", "2", "--zero", "3", "--schedule", "1f1b"], ["--microbatches", "2"], 6),
    slow(16, ["--dp", "2", "--cp", "2", "--tp", "2", "--ep", "4", "--schedule", "interleaved"],
         ["--experts", "8", "--top-k", "2", "--microbatches", "2"], 6),
], ids=flags_id)
def test_5d_matches_the_baseline_step_by_step(tmp_path, baseline, nproc, layout, model, steps):
    assert_exact(tmp_path, baseline, nproc, layout, model, steps)


@pytest.mark.parametrize("nproc,layout,tokens", [
    (4, ["--cp", "2", "--ep", "2"], 32),                                        # S/C, pp 2
    slow(8, ["--tp", "2", "--cp", "2", "--sequence-parallel"], 16),            # S/(C*T) under sequence parallelism
], ids=flags_id)
def test_pipeline_messages_carry_my_token_shard(tmp_path, nproc, layout, tokens):
    run = launch("parallel_5d.py", RUN + MOE + ["--steps", "1"] + layout, tmp_path, nproc=nproc)
    assert run.returncode == 0, run.stderr[-2000:]
    said = run.stdout.split("a sample's message from rank 0:\n", 1)[1].splitlines()[0]   # the start-up's cut line
    assert said.startswith(f"    the activation [{tokens}, 16] = [S/"), said


@pytest.mark.parametrize("fault,layout,model", [
    ("rank-order", ["--cp", "2", "--ep", "2"], CAPACITY),           # per-rank counts: the wrong tokens dropped
    slow("edp-average", ["--dp", "2", "--cp", "2", "--ep", "2"], MOE),   # experts / edp size: N times too large
    slow("cp-head-unscaled", ["--cp", "2", "--ep", "2"], MOE),      # cp-partial gradients / C
    slow("norm-every-ep-rank", ["--cp", "2", "--ep", "2"], MOE),    # dense weights counted twice in the norm
    slow("contiguous-keys", ["--dp", "2", "--ep", "2"], MOE),       # dropout masks of other samples
    slow("aux-unscaled", ["--dp", "2", "--cp", "2", "--ep", "2"], MOE),   # the router's load-balancing gradient / D*C
], ids=flags_id)
def test_each_pitfall_put_back_is_caught(tmp_path, baseline, fault, layout, model):
    """tests/broken_5d.py runs the program with one part wrong: the comparison above must see it."""
    args = RUN + ["--steps", "3"] + model
    run = launch("tests/broken_5d.py", [fault] + args + layout, tmp_path, nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = baseline(args)
    got, want = run.events("train"), reference.events("train")
    worst = max(max(abs(a["loss"] - b["loss"]), abs(a["grad_norm"] - b["grad_norm"])) for a, b in zip(got, want))
    assert worst > 1e-5, f"{fault}: still within {worst:.3g} of the baseline, so the test cannot see it"


@pytest.mark.parametrize("argv,world,message", [
    (["--dp", "2", "--cp", "2", "--tp", "2"], 12,
     "error: the world size 12 is not divisible by --dp 2 x --cp 2 x --tp 2"),
    (["--dp", "2", "--cp", "1", "--experts", "4", "--ep", "4"], 4, "error: --ep 4 does not divide --dp 2 x --cp 1"),
    (["--dp", "2", "--experts", "3", "--ep", "2"], 4, "error: --experts 3 is not divisible by --ep 2"),
    (["--tp", "3", "--heads", "4"], 3, "error: --heads 4 is not divisible by the tensor-parallel degree 3"),
    (["--tp", "2", "--cp", "2", "--attention", "ulysses", "--heads", "2", "--hidden", "16"], 4,
     "error: --heads 2 is not divisible by --tp 2 x --cp 2"),
    (["--cp", "3"], 3, "error: the vit's 64 tokens (--patch-size 4) are not divisible by --cp 3"),
    (["--tp", "2", "--cp", "2", "--sequence-parallel", "--patch-size", "2"], 4,
     "error: --sequence-parallel splits the vit's 64 tokens of --patch-size 4"),
    (["--model", "cnn", "--cp", "2"], 2,
     "error: parallel_5d.py trains the vit or the gpt, whose blocks every axis cuts"),
    (["--model", "mlp", "--tp", "2"], 4, "error: parallel_5d.py trains the vit"),   # was a traceback at --cp 1
    (["--model", "mlp", "--experts", "4"], 1, "error: --model mlp does not use --experts"),
], ids=flags_id)
def test_bad_input_is_one_error_line(argv, world, message, monkeypatch, capsys):
    assert_one_error_line(p5.parse_args, FAST + argv, world, message, monkeypatch, capsys)


BASE = ("single_baseline.py", 1, [])


@pytest.mark.parametrize("model,chain", [
    (MOE, [BASE, ("parallel_5d.py", 4, ["--cp", "2", "--ep", "2"]), BASE]),              # experts saved by name
    slow(MOE, [BASE, ("parallel_5d.py", 4, ["--dp", "2", "--cp", "2", "--ep", "2", "--zero", "3"]), BASE]),
    # one microbatch (expert_parallel.py routes the whole batch): the 5-D mesh to expert_parallel.py and back
    slow(["--experts", "4", "--top-k", "2", "--capacity-factor", "1.0"],
         [BASE, ("parallel_5d.py", 4, ["--dp", "2", "--cp", "2", "--ep", "2", "--zero", "2", "--microbatches", "1"]),
          ("expert_parallel.py", 2, []), ("parallel_5d.py", 4, ["--cp", "2", "--ep", "2", "--microbatches", "1"])]),
    # dense: the 5-D mesh's ZeRO-3 slices to the 3-D program's grid and back
    slow(["--microbatches", "2"], [BASE, ("parallel_5d.py", 4, ["--dp", "2", "--cp", "2", "--zero", "3"]),
                                   ("parallel_3d.py", 4, ["--dp", "2", "--tp", "2"]),
                                   ("parallel_5d.py", 4, ["--tp", "2", "--cp", "2", "--sequence-parallel"])]),
], ids=flags_id)
def test_resume_across_layouts_continues_the_baseline(tmp_path, baseline, model, chain):
    """Layout after layout, two steps each, through one checkpoint directory (written in the baseline's
    coordinates): the uninterrupted baseline's losses."""
    args = RUN + model + ["--save-every", "2"]
    whole = baseline(args + ["--steps", str(2 * len(chain))])
    losses = []
    for k, (program, nproc, extra) in enumerate(chain):
        steps = 2 * (k + 1)
        part = args + ["--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt")] + extra
        run = launch(program, part, tmp_path, nproc=nproc, log_name=f"part{steps}.jsonl")
        assert run.returncode == 0, run.stderr[-2000:]
        assert [r["step"] for r in run.events("train")] == list(range(steps - 2, steps))
        losses += run.losses()
    worst = max(abs(a - b) for a, b in zip(losses, whole.losses()))
    assert len(losses) == 2 * len(chain) and worst <= 1e-6, worst


@pytest.mark.parametrize("layout", [slow(["--cp", "2", "--ep", "2"]), ["--dp", "2", "--ep", "2"]], ids=flags_id)
def test_the_evaluation_routes_the_test_batch_as_the_baseline_does(tmp_path, baseline, layout):
    """cp ranks evaluate their tokens of each test batch, replicas their slice of it, their counts gathered:
    the capacity drops what the baseline's evaluation drops, so the test loss and accuracy are the baseline's
    (each replica running the whole batch, as before: 3.1e-4 off in the test loss here)."""
    args = RUN[:RUN.index("--eval-every")] + RUN[RUN.index("--eval-every") + 2:] + CAPACITY + ["--steps", "2",
                                                                                              "--eval-every", "1"]
    run = launch("parallel_5d.py", args + layout, tmp_path, nproc=4)
    assert run.returncode == 0, run.stderr[-2000:]
    got, want = run.events("eval"), baseline(args).events("eval")
    assert len(got) == len(want) == 2
    assert max(abs(a["test_loss"] - b["test_loss"]) for a, b in zip(got, want)) <= 1e-6
    assert [a["test_acc"] for a in got] == [b["test_acc"] for b in want]


def test_a_dp_that_does_not_divide_the_test_batch_evaluates_as_the_baseline(tmp_path, baseline):
    """--dp 3 with --capacity-factor: 3 does not divide a test batch of 500, so the replicas take 167, 167 and 166
    samples and pad their counts with empty rows to 167 (mp.ep.order.gather_blocks): the capacity drops what the
    baseline's evaluation drops (issue 82: refused before)."""
    i = RUN.index("--eval-every")
    args = RUN[:i] + RUN[i + 2:] + CAPACITY + ["--batch-size", "12", "--steps", "2", "--eval-every", "2"]
    run = launch("parallel_5d.py", args + ["--dp", "3"], tmp_path, nproc=3)
    assert run.returncode == 0, run.stderr[-2000:]
    got, want = run.events("eval"), baseline(args).events("eval")
    assert len(got) == len(want) == 1 and abs(got[0]["test_loss"] - want[0]["test_loss"]) <= 1e-6, (got, want)
    assert got[0]["test_acc"] == want[0]["test_acc"]


def test_a_moe_layer_reads_the_device_once_a_microbatch(tmp_path, monkeypatch):
    """The one declared read (mp.moe.rows_per_expert) a MoE layer a microbatch, and no other read in a step:
    pp 2 x cp 2 puts one MoE block on each stage, run for M = 2 microbatches a step (tests/count_reads.py)."""
    monkeypatch.setenv("COUNT_PROGRAM", "parallel_5d.py")
    monkeypatch.setenv("COUNT_DIR", str(tmp_path))
    sgd = RUN[:RUN.index("--optimizer")]   # (torch's AdamW reads its step counts: not ours to count)
    run = launch("tests/count_reads.py", sgd + CAPACITY + ["--steps", "4", "--cp", "2", "--ep", "2"], tmp_path,
                 nproc=4, log_name="log.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.load(open(path)) for path in sorted(glob.glob(str(tmp_path / "rank-*.json")))]
    assert len(ranks) == 4 and all(r["steps"] == 4 for r in ranks), ranks
    assert all(r["declared_reads"] == 1 * 2 * 4 for r in ranks), ranks
    # and nothing else: every stage's routing record is gathered after the last step (mp.loop, Sums.routing)
    assert all(r["step_reads"] == r["declared_reads"] for r in ranks), [r["step_reads"] for r in ranks]


@pytest.mark.parametrize("program,layout,status", [
    ("parallel_5d.py", ["--dp", "2", "--cp", "2", "--ep", "2"], 0),
    ("parallel_5d.py", ["--dp", "2", "--ep", "2", "--microbatches", "2"], 0),   # pp 2: each microbatch routed alone
    slow("parallel_5d.py", ["--tp", "2", "--cp", "2", "--sequence-parallel"], 0),
    ("tests/broken_5d.py", ["edp-average", "--dp", "2", "--cp", "2", "--ep", "2"], 1),   # --check sees it too
    # --zero: my slices of the dense and the experts' buckets, several a stage (issue 82: --check was refused)
    ("parallel_5d.py", ["--dp", "2", "--cp", "2", "--ep", "2", "--zero", "2", "--bucket-mb", "0.002"], 0),
    slow("parallel_5d.py", ["--dp", "2", "--tp", "2", "--ep", "2", "--zero", "3", "--bucket-mb", "0.002"], 0),
    slow("tests/broken_5d.py", ["edp-average", "--dp", "2", "--cp", "2", "--ep", "2", "--zero", "1"], 1),
], ids=flags_id)
def test_check_compares_every_shard_with_the_full_model(tmp_path, program, layout, status):
    """--check against a full model that routes each microbatch of the batch on its own, as the run does
    (at M = 2 with a capacity of 1.0, routing the batch as one would keep other tokens)."""
    args = RUN[:RUN.index("--optimizer")] + ["--experts", "4", "--top-k", "2", "--capacity-factor", "1.0",
                                             "--microbatches", "1", "--check"]
    run = launch(program, layout[:1] + args + layout[1:] if program.startswith("tests") else args + layout,
                 tmp_path, nproc=4)
    assert run.returncode == status, run.stderr[-2000:]
    assert ("all tensors match the full model" in run.stdout) == (status == 0), run.stdout[-2000:]


@pytest.mark.parametrize("layout", [["--cp", "2", "--microbatches", "4"], ["--dp", "2", "--microbatches", "2"]],
                         ids=flags_id)
def test_a_dense_check_runs_the_schedules_microbatches(tmp_path, layout):
    """--check of a dense 5-D run over the schedule's microbatches (pp 2 x cp 2, M = 4; pp 2 x dp 2, M = 2):
    my outputs, microbatch after microbatch, compared with the full model's at my samples (a replica's are
    a part of every microbatch, not one slice of the batch), with dropout keyed by the baseline's sample."""
    args = RUN[:RUN.index("--optimizer")] + ["--schedule", "1f1b", "--check"] + layout
    run = launch("parallel_5d.py", args, tmp_path, nproc=4)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "all tensors match the full model" in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("program,layout,model", [
    slow("parallel_3d.py", ["--dp", "2", "--tp", "2", "--zero", "2", "--bucket-mb", "0.002"], []),
], ids=flags_id)   # parallel_5d.py's case: test_under_tp_each_token_is_routed_once
def test_the_tp_average_runs_before_the_buckets_that_hold_its_gradients_start(tmp_path, baseline, program, layout,
                                                                              model):
    """On a GPU the replicated parameters' gradients (norms; the experts under tp without sequence parallelism)
    are averaged over tp after the backward, in the very .grad views the data-parallel buckets hold:
    tests/tp_order.py switches that average on here and stops the run if a bucket holding one of them started
    first (issue 82: parallel_5d.py started them during the backward, two collectives on one buffer). The run
    still matches the baseline step by step."""
    args = RUN + ["--steps", "2"] + model
    run = launch("tests/tp_order.py", [program] + args + layout, tmp_path, nproc=4,
                 log_name="tp_order.jsonl")
    assert run.returncode == 0, run.stderr[-2000:]
    got, want = run.events("train"), baseline(args).events("train")
    assert max(abs(a["loss"] - b["loss"]) + abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, want)) <= 1e-6


def test_under_tp_each_token_is_routed_once(tmp_path, baseline):
    """ep folded over dp x cp x tp (Megatron's MoE folding): at --dp 2 --tp 2 --ep 2 an expert group is a tp pair,
    exact, and each tp rank routes its own half of the tokens, so a rank sends about half the all-to-all bytes of
    the same run at --tp 1 (issue 82: every tp rank routed all of them, T times the expert work and bytes; here
    0.128 MB a rank a step at --tp 1 and --tp 2 before, 0.062 now). The run goes through tests/tp_order.py, with
    --zero 2 and several buckets: the tp average of the replicated gradients precedes their buckets (above)."""
    args = RUN + ["--steps", "3"] + MOE
    folded = launch("tests/tp_order.py", ["parallel_5d.py"] + args + ["--dp", "2", "--tp", "2", "--ep", "2", "--zero",
                                                                    "2", "--bucket-mb", "0.002"], tmp_path, nproc=4)
    assert folded.returncode == 0, folded.stderr[-2000:]
    got, want = folded.events("train"), baseline(args).events("train")
    assert max(abs(a["loss"] - b["loss"]) + abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, want)) <= 1e-6
    assert folded.events("summary")[0]["tokens_per_expert"] == baseline(args).events("summary")[0]["tokens_per_expert"]
    args = args + ["--dp", "2", "--ep", "2"]
    whole = launch("parallel_5d.py", args, tmp_path, nproc=2, log_name="tp1.jsonl")
    assert whole.returncode == 0, whole.stderr[-2000:]
    sent = [sum(run.events("summary")[0]["all_to_all_mb_per_step"].values()) / nproc
            for run, nproc in ((folded, 4), (whole, 2))]
    assert 0.4 < sent[0] / sent[1] < 0.6, sent
    for run in (folded, whole):   # mp/traffic.py counts the ep group's bytes at the calls: the same numbers
        summary = run.events("summary")[0]
        assert summary["sent_mb_per_step"]["ep"] == summary["all_to_all_mb_per_step"], summary["sent_mb_per_step"]
