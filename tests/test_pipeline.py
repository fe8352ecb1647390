"""pipeline_microbatch.py under torchrun on gloo: the baseline's losses, --check, bad input, memory."""
import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import pipeline_microbatch as pm
from mp.pp.evaluate import evaluate_pipeline
from mp.pp.training import check_step
from mp.loop import evaluate, whole_model_run
from mp.dist import Env, torchrun_env
from mp.models import build_model
from mp.data import Cifar10Data, SyntheticData, load_data, next_batch
from helpers import FAST, assert_one_error_line, assert_same_losses, launch, peer_lost, run_ranks, slow
from mp.check import check_one_step
from mp.pp.zero_bubble import FUSED_MIN_WEIGHT
from mp.pp.schedules import SCHEDULES, placement_of, schedule_actions

MLP = FAST + ["--model", "mlp", "--hidden", "32", "--layers", "8", "--batch-size", "24"]


@pytest.mark.parametrize("schedule,stages,microbatches,extra", [
    ("gpipe", 4, 4, []), slow("gpipe", 3, 1, []), slow("1f1b", 4, 2, []), ("1f1b", 4, 6, ["--balance", "1,1,1,5"]),
    ("interleaved", 2, 4, []), ("zb", 4, 2, []), slow("zb", 3, 3, ["--recompute"]), slow("gpipe", 2, 4, ["--recompute"])])
def test_per_step_loss_equals_the_baseline(tmp_path, baseline, schedule, stages, microbatches, extra):
    args = MLP + ["--steps", "20"]
    run = launch("pipeline_microbatch.py", args + extra + ["--schedule", schedule, "--microbatches", str(microbatches)],
                 tmp_path, nproc=stages)
    assert_same_losses(run, baseline(args))


@pytest.mark.parametrize("model,extra,schedule,ours", [
    ("cnn", [], "1f1b", []), slow("vit", ["--hidden", "16", "--layers", "6", "--heads", "2"], "interleaved", []),
    slow("cnn", [], "zb", ["--recompute"])])      # zb splits the convolutions' backward too
def test_cnn_and_vit_with_eval_match_the_baseline(tmp_path, baseline, model, extra, schedule, ours):
    args = ["--data", "synthetic", "--model", model, "--steps", "12", "--batch-size", "16", "--eval-every", "6"] + extra
    run = launch("pipeline_microbatch.py", args + ["--microbatches", "4", "--schedule", schedule] + ours,
                 tmp_path, nproc=4)
    base = baseline(args)
    assert_same_losses(run, base)
    for got, want in zip(run.events("eval"), base.events("eval"), strict=True):
        assert got["step"] == want["step"] and abs(got["test_loss"] - want["test_loss"]) < 1e-4
        assert got["test_acc"] == want["test_acc"]


@pytest.mark.parametrize("schedule,extra", [("gpipe", []), ("1f1b", []), ("interleaved", []), ("zb", []),
                                            ("interleaved", ["--recompute"])])
def test_check_compares_every_tensor_with_the_full_model(tmp_path, schedule, extra):
    run = launch("pipeline_microbatch.py", MLP + ["--check", "--schedule", schedule, "--microbatches", "4"] + extra,
                 tmp_path, nproc=2)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("all tensors match the full model") == 1, run.stdout


def test_timeline_is_a_chrome_trace_with_the_bubble(tmp_path):
    trace_path = tmp_path / "trace.json"
    run = launch("pipeline_microbatch.py", MLP + ["--steps", "2", "--microbatches", "4", "--schedule", "gpipe",
                                                  "--timeline", str(trace_path)], tmp_path, nproc=3)
    assert run.returncode == 0, run.stderr[-2000:]
    trace = json.loads(trace_path.read_text())
    compute = [e for e in trace["traceEvents"] if e["cat"] in ("forward", "backward")]
    assert len(compute) == 3 * 2 * 4 and {e["pid"] for e in compute} == {0, 1, 2}
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in trace["traceEvents"])
    other = trace["otherData"]
    assert other["bubble_theory"] == pytest.approx(2 / 6) and 0 < other["bubble_measured"] < 1


@pytest.mark.slow
def test_a_thousand_microbatches_recompute_and_1f1b_do_not_hold_them_all(tmp_path):
    """1000 microbatches of four samples on 4 stages. GPipe's first stage holds the activations of all
    1000 at once (74 kB a sample for the cnn's two conv blocks: about 300 MB); with --recompute only
    their inputs (12 kB a sample: 49 MB); 1F1B's at most 4 microbatches, and its first stage draws each
    microbatch's inputs when it needs them, so every stage peaks as it does with 10 microbatches."""
    args = FAST + ["--model", "cnn", "--microbatches", "1000", "--batch-size", "4000", "--steps", "1"]
    runs = {name: launch("pipeline_microbatch.py", args + flags, tmp_path, nproc=4, log_name=f"{name}.jsonl")
            for name, flags in [("gpipe", ["--schedule", "gpipe"]),
                                ("recompute", ["--schedule", "gpipe", "--recompute"]),
                                ("1f1b", ["--schedule", "1f1b"]),
                                ("1f1b-m10", ["--schedule", "1f1b", "--microbatches", "10", "--batch-size", "40"])]}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs["gpipe"].losses() == pytest.approx(runs["1f1b"].losses(), abs=1e-6)
    assert runs["recompute"].losses() == runs["gpipe"].losses()                  # exactly: the same arithmetic
    peak = {name: {int(r): mb for r, mb in run.events("summary")[0]["peak_memory_mb"].items()}
            for name, run in runs.items()}
    # RSS varies by ~25 MB from run to run; measured: 218 and 308 MB
    assert peak["gpipe"][0] - peak["recompute"][0] > 150, f"peak memory of stage 0 in MB: {peak}"
    assert peak["gpipe"][0] - peak["1f1b"][0] > 200, f"peak memory of stage 0 in MB: {peak}"
    assert all(peak["1f1b"][r] - peak["1f1b-m10"][r] < 30 for r in range(4)), f"peak memory per stage in MB: {peak}"


def test_sends_in_flight_are_only_the_last_exchanges(tmp_path):
    """The memory bounds of Messenger.exchange, on 2 spawned ranks for every schedule: sends in flight
    only from the last exchange that sent (zbv on gloo: from this step), receives posted early only
    for the next exchanges."""
    run_ranks(_sends_in_flight_case, 2, tmp_path)


def _sends_in_flight_case(rank, world, group):
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    x, y = SyntheticData(0).batch(0, 24)
    for schedule in SCHEDULES:
        args = pm.parse_args(MLP + ["--schedule", schedule, "--microbatches", "4"])
        pos = pm.PipelineRank(rank, world, list(range(world)), args.virtual_stages, placement=placement_of(schedule))
        _, runner = pm.setup_stage(args, env, pos)
        messenger, exchange, last_sends = runner.messenger, runner.messenger.exchange, []

        def watched(parts, outbox, mb_size, record, ahead, meanwhile=None):
            inbox = exchange(parts, outbox, mb_size, record, ahead, meanwhile)
            sent = [part for part in parts if part[0] == "send"]
            last_sends[:] = (last_sends if messenger.sends_at_once else []) + sent if sent else last_sends
            in_flight = [part for _, _, part in messenger.sending]
            # zbv on gloo (sends at once): every send of the step so far, waited at its end (mp.pp.p2p)
            assert all(part in last_sends for part in in_flight), (schedule, in_flight, last_sends)
            assert messenger.sends_at_once == (schedule == "zbv")
            # gloo's receives posted early: only those of the next exchanges (pm.EXCHANGES_AHEAD of them)
            assert set(messenger.early.posted) <= {msg for _, _, msg in ahead}, (schedule, messenger.early.posted)
            early.append(len(messenger.early.posted))
            return inbox
        messenger.exchange, early = watched, []
        pm.forward_backward(runner, schedule_actions(schedule, pos, 4, sends_at_once=messenger.sends_at_once), x, y, 4)
        assert messenger.sending == [], f"{schedule}: sends left in flight after the step"
        assert last_sends, f"{schedule}: no exchange sent anything"
        assert max(early) > 0 and messenger.early.posted == {}, (schedule, early)   # each taken by its exchange


def test_a_peer_lost_while_the_timelines_gather_is_named(monkeypatch):
    """--timeline's gathering after the run is a collective: a peer lost there is one line naming it."""
    import mp.pp.timeline as timeline
    from mp.errors import CommError

    monkeypatch.setattr(timeline.dist, "all_gather_object", peer_lost)
    monkeypatch.setattr(timeline.dist, "get_rank", lambda: 1)
    args = pm.parse_args(MLP + ["--timeout-s", "9"])
    recorder = timeline.Timeline(args, SimpleNamespace(events=None, origin=0.0),
                                 SimpleNamespace(pp_rank=1, pp_size=2, group=None), owner=False)
    recorder.recorded = []                # the recorded steps' events (none): write() gathers them
    with pytest.raises(CommError) as e:
        recorder.write()
    assert str(e.value).startswith("rank 1 waited for its pipeline's timelines (--timeline), and gave up "
                                   "(timeout 9 s): [../third_party/gloo/"), str(e.value)


def test_a_peer_lost_while_the_check_gathers_is_named(monkeypatch):
    """--check's verdicts gathered over every rank: a peer lost there is one line naming it."""
    import mp.check as check
    from mp.errors import CommError

    monkeypatch.setattr(check, "check_one_step", lambda *args, **kwargs: [])   # this rank's comparisons: none
    monkeypatch.setattr(check.dist, "all_gather_object", peer_lost)
    with pytest.raises(CommError) as e:
        check.check_and_exit(SimpleNamespace(rank=1, world_size=2), SimpleNamespace(timeout_s=9), "gpipe", None,
                             None, None, None)
    assert str(e.value).startswith("rank 1 waited for every rank's --check results, and gave up (timeout 9 s): "
                                   "[../third_party/gloo/"), str(e.value)


def test_evaluation_covers_a_test_split_that_batches_do_not_divide(tmp_path):
    """700 and 300 test images: the batches of 500 leave a smaller last one (or are all smaller), which
    the pipeline evaluates in a pass of its own size; loss and accuracy equal the baseline's."""
    run_ranks(_uneven_test_split_case, 2, tmp_path)


@contextlib.contextmanager
def no_reads():
    """Inside: a tensor's value taken into Python (what makes a host wait for its GPU) raises."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor was read back inside the evaluation")
    reads = ("item", "tolist", "__float__", "__int__", "__bool__")
    saved = {name: getattr(torch.Tensor, name) for name in reads}
    for name in reads:
        setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _uneven_test_split_case(rank, world, group):
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    args = pm.parse_args(MLP)
    pos = pm.PipelineRank(rank, world, list(range(world)), args.virtual_stages)
    for size in (700, 300):
        data = SyntheticData(0, test_size=size)
        _, runner = pm.setup_stage(args, env, pos)
        with no_reads():                  # the figures stay on the device: the loop reads them (settle)
            got = evaluate_pipeline(runner, pos, data, env.device)
        if pos.is_last_stage:
            want = evaluate(data, env.device, whole_model_run(build_model(args), env.device))
            assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5), size


def test_check_fails_naming_a_tensor_that_differs():
    """In one process (one stage, no messages): the check passes, then catches a stage that scales its output."""
    args = pm.parse_args(FAST + ["--model", "mlp", "--hidden", "16", "--layers", "3", "--batch-size", "8",
                                 "--microbatches", "2"])
    env, pos = torchrun_env("gloo"), pm.PipelineRank(0, 1, [0])
    x, y = load_data(args).batch(0, args.batch_size)
    model, runner = pm.setup_stage(args, env, pos)
    results = check_one_step(args, model, check_step(runner, schedule_actions("1f1b", pos, 2), 2, pm.forward_backward), x, y)
    assert len(results) == 2 + 2 * len(list(model.parameters())) and max(d for _, d, _ in results) < 1e-5
    assert not [what for what, _, error in results if error]
    model, runner = pm.setup_stage(args, env, pos)
    runner.chunks[0] = torch.nn.Sequential(runner.chunks[0], Scale(1.001))   # not in the reference copy
    results = check_one_step(args, model, check_step(runner, schedule_actions("1f1b", pos, 2), 2, pm.forward_backward), x, y)
    assert "output" in [what for what, _, error in results if error], results


class Scale(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


@pytest.mark.parametrize("argv,world,message", [
    (["--microbatches", "5"], 2, "error: --batch-size 24 is not divisible by --microbatches 5; "),
    (["--schedule", "interleaved", "--microbatches", "6"], 4,
     "error: --schedule interleaved needs --microbatches a multiple of the 4 stages, got 6; "
     "use --microbatches 4 or --microbatches 8"),
    (["--balance", "4,3"], 2, "error: --balance 4,3 must give 2 positive block counts summing to the 8 blocks"),
    (["--balance", "4,x"], 2, "error: --balance '4,x' must be comma-separated integers"),
    ([], 9, "error: 9 pipeline stages but the mlp has only 8 blocks"),
    (["--schedule", "interleaved", "--virtual-stages", "0"], 2, "error: --virtual-stages 0 must be a positive"),
    (["--schedule", "1f1b", "--virtual-stages", "3"], 2,
     "error: --virtual-stages 3 applies only to --schedule interleaved"),
    (["--layers", "1"], 2, "error: --layers 1: the mlp needs at least 2"),
    (["--schedule", "zbv", "--virtual-stages", "3"], 2, "error: --schedule zbv places exactly 2 chunks on each rank, "
     "in a V (rank r holds virtual stages r and 2p-1-r), not --virtual-stages 3; use --virtual-stages 2 or "
     "--schedule interleaved"),
    (["--schedule", "zbv"], 5, "error: 5 stages x 2 virtual stages = 10 chunks but the mlp has only 8 blocks"),
])
def test_bad_input_is_one_error_line_and_exit_2(monkeypatch, capsys, argv, world, message):
    assert_one_error_line(pm.parse_args, MLP + argv, world, message, monkeypatch, capsys)


@pytest.mark.slow
def test_bad_input_under_torchrun_fails_on_every_rank(tmp_path):
    """Under the real torchrun (not the tests' zygote): one error line on the console, and torchrun's
    report names our exit status 2, shows that line for each rank (mp.errors.tell_torchrun) and no
    line of our code. Slow (two ranks import torch, up to three tries): the quick subset checks the same
    input's line in process (above, and rank 0 alone below)."""
    line = "error: --batch-size 24 is not divisible by --microbatches 5"
    for _ in range(3):   # a rank still importing torch when another failed is stopped by torchrun (SIGTERM) before
        run = launch("pipeline_microbatch.py", MLP + ["--microbatches", "5"], tmp_path, nproc=2, timeout=60,
                     real=True)   # its check: nothing of ours to see (once in 17 min of a loaded suite); again
        if "(SIGTERM)" not in run.stderr:
            break
    assert run.returncode != 0
    assert [x for x in run.stderr.splitlines() if x.startswith("error:")] == [line + "; use --batch-size 20 or --batch-size 25"]
    assert run.stderr.count(f"traceback : {line}") == 2, run.stderr[-3000:]   # the report: both ranks
    assert "exitcode  : 2" in run.stderr and 'pipeline_microbatch.py", line' not in run.stderr


def test_bad_input_is_printed_by_rank_0_alone_but_every_rank_exits_2(monkeypatch, capsys):
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)          # what torchrun tells each rank
        with pytest.raises(SystemExit) as exit_:
            pm.parse_args(MLP + ["--microbatches", "5"])
        assert exit_.value.code == 2 and capsys.readouterr().err.count("error: ") == lines


def test_labels_alone_are_the_labels_of_the_batch():
    """The last stage draws labels without images; they must be the first stage's samples' labels."""
    synthetic = SyntheticData(3)
    cifar = Cifar10Data.__new__(Cifar10Data)        # CIFAR-10 shaped, without the download
    cifar.train, cifar.seed = (torch.randint(256, (100, 3, 32, 32), dtype=torch.uint8), torch.randint(10, (100,))), 5
    for data in (synthetic, cifar):
        for step in (0, 7, 12):
            assert torch.equal(data.labels(step, 16), data.batch(step, 16)[1])


@pytest.mark.parametrize("data", ["synthetic", "cifar"])
def test_streamed_microbatches_are_the_batch_cut_in_order(data):
    """The first stage draws each microbatch when its forward reads it: the same samples as batch()."""
    if data == "synthetic":
        source = SyntheticData(3)
    else:
        source = Cifar10Data.__new__(Cifar10Data)        # CIFAR-10 shaped, without the download
        images = torch.randint(256, (100, 3, 32, 32), dtype=torch.uint8)
        source.train, source.seed = (images, torch.randint(10, (100,))), 5
    args = pm.parse_args(MLP + ["--batch-size", "12", "--microbatches", "3"])
    for step, (dp_rank, dp_size) in [(0, (0, 1)), (4, (0, 1)), (2, (1, 2)), (2, (0, 4))]:
        x, _ = source.batch(step, 12)
        streamed, _ = next_batch(source, step, args, pm.PipelineRank(0, 2, [0, 1]), torch.device("cpu"),
                                 (dp_rank, dp_size), stream=True)
        mine = x.chunk(dp_size)[dp_rank].chunk(3)
        assert len(streamed) == 12 // dp_size
        for mb in range(3):
            assert torch.equal(streamed[mb], mine[mb]), (data, step, mb)
        with pytest.raises(AssertionError, match="out of order"):
            streamed[1]


def plain_gpipe_step(chunk, pos, x_mb, head, m, in_shape):
    """GPipe written out as a loop with blocking dist.send/dist.recv (picotron's all-forward-all-backward):
    an oracle independent of the executor and its Messenger. No cycle can form: in each phase
    messages flow one way only."""
    saved = []
    for mb in range(m):
        if pos.is_first_stage:
            x = x_mb[mb]
        else:
            x = torch.empty(in_shape)
            dist.recv(x, pos.prev_rank)
            x.requires_grad_()
        y = chunk(x)
        if pos.is_last_stage:
            y = head(mb, y)                   # the scaled loss: the last stage's backward starts there
        else:
            dist.send(y.detach().contiguous(), pos.next_rank)
        saved.append((x, y))
    for x, y in saved:
        grad = None
        if not pos.is_last_stage:
            grad = torch.empty_like(y)
            dist.recv(grad, pos.next_rank)
        torch.autograd.backward(y, grad)
        if not pos.is_first_stage:
            dist.send(x.grad, pos.prev_rank)


# 320 x 320 weights and the 3072 x 320 first layer: gpipe, 1f1b and interleaved add their weight gradients
# in place right after each B (split "B", mp.pp.zero_bubble.FUSED_MIN_WEIGHT), where the small test models don't
FUSED = FAST + ["--model", "mlp", "--hidden", "320", "--layers", "4", "--batch-size", "24"]


@pytest.mark.parametrize("model", [slow("cnn"), "mlp"])
def test_plain_gpipe_equals_the_executors_gpipe(tmp_path, model):
    """GPipe written out as a plain loop and the executor playing mp.pp.schedules' gpipe: the same
    loss, bit for bit, and the same gradients to float rounding, on 3 spawned ranks. The cnn:
    convolutions and small linears, all through autograd; the mlp of 320: every linear layer's W
    added in place right after its B (mp.pp.zero_bubble), checked to be so."""
    run_ranks(_plain_gpipe_cnn if model == "cnn" else _plain_gpipe_mlp, 3, tmp_path)


def _plain_gpipe_cnn(rank, world, group):
    _plain_gpipe_case(rank, world, FAST + ["--model", "cnn", "--batch-size", "12"], fused=False)


def _plain_gpipe_mlp(rank, world, group):
    _plain_gpipe_case(rank, world, FUSED + ["--batch-size", "12", "--layers", "3"], fused=True)


def _plain_gpipe_case(rank, world, model_args, fused):
    import torch.nn.functional as F
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    x, y = SyntheticData(0).batch(0, 12)
    args = pm.parse_args(model_args + ["--schedule", "gpipe", "--microbatches", "4"])
    pos = pm.PipelineRank(rank, world, list(range(world)))
    grads, losses = [], []
    for plain in (True, False):
        if plain:                             # the chunk as built: autograd takes every gradient
            model, chunks, shapes = pm.build_stage_model(args, pos, env.device)
            mine = []

            def head(mb, logits):
                mine.append(F.cross_entropy(logits, y.chunk(4)[mb]) / 4)
                return mine[-1]
            plain_gpipe_step(chunks[0], pos, x.chunk(4), head, 4, (3, *shapes[rank]))
            losses.append(torch.stack(mine).sum().item() if mine else None)
        else:                                 # the executor's: each weight gradient added in place after its B
            model, runner = pm.setup_stage(args, env, pos)
            fused_weights = [w for stash in runner.stashes for w in stash.weights]   # W right after B on these
            assert all(w.numel() >= FUSED_MIN_WEIGHT for w in fused_weights) and (fused or not fused_weights)
            assert not fused or rank > 0 or fused_weights   # rank 0 holds the 3072 x 320 first layer
            loss = pm.forward_backward(runner, schedule_actions("gpipe", pos, 4), x, y, 4)
            losses.append(None if loss is None else loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[0] == losses[1], losses
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:                     # to rounding: the split sums a bias and adds dy^T x its own way
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow   # a dropout-and-clipping run (the plain-gpipe mlp case checks the fused gradients quickly)
def test_fused_weight_gradients_keep_the_baseline(tmp_path, baseline):
    """Split "B" under the schedules and programs that run it: 1f1b and interleaved on 2 stages, and
    the joint program's 1f1b on 2 x 2, whose buckets start once a chunk's last B has added its weight
    gradients in place; with dropout and clipping, every step's loss is the baseline's."""
    args = FUSED + ["--steps", "6", "--dropout", "0.1", "--clip-grad-norm", "0.5"]
    for i, (program, extra, n) in enumerate([("pipeline_microbatch.py", ["--schedule", "1f1b"], 2),
                                             ("pipeline_microbatch.py", ["--schedule", "interleaved"], 2),
                                             ("pipeline_dp_joint.py", ["--schedule", "1f1b", "--dp", "2"], 4)]):
        run = launch(program, args + extra, tmp_path, nproc=n, log_name=f"fused{i}.jsonl")
        assert_same_losses(run, baseline(args))


def test_a_fused_w_runs_once_its_b_has_sent_its_gradient(tmp_path):
    """Split "B" (gpipe, 1f1b, interleaved on 2 spawned ranks, linears of 320): each microbatch's W runs
    once per chunk, after its B, and on a chunk that sends its input's gradient upstream only once
    that send is posted: the stage before waits for dx, not for W (StageRunner.run, the exchange's
    meanwhile). Running W inside its B, as before, fails it."""
    run_ranks(_fused_w_case, 2, tmp_path)


def _fused_w_case(rank, world, group):
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    x, y = SyntheticData(0).batch(0, 24)
    for schedule in ("gpipe", "1f1b", "interleaved"):
        args = pm.parse_args(FUSED + ["--schedule", schedule, "--microbatches", "4"])
        pos = pm.PipelineRank(rank, world, list(range(world)), args.virtual_stages, placement=placement_of(schedule))
        _, runner = pm.setup_stage(args, env, pos)
        exchange, posted, ran, backs = runner.messenger.exchange, set(), [], set()

        def watched(parts, *rest):
            posted.update(msg for kind, _, msg in parts if kind == "send")   # posted before meanwhile runs
            return exchange(parts, *rest)
        runner.messenger.exchange = watched
        split = [chunk for chunk, stash in enumerate(runner.stashes) if stash.weights]   # (not the classifier alone)
        assert split, (schedule, rank)
        for chunk, stash in enumerate(runner.stashes):

            def logged(mb, grads=None, chunk=chunk, w=stash.weight_grads):
                vstage = runner.vstage(chunk)
                assert (mb, chunk) in backs and (vstage == 0 or ("grad", mb, vstage - 1) in posted), \
                    (schedule, rank, f"W of microbatch {mb} on virtual stage {vstage} before its gradient was sent")
                ran.append((mb, chunk))
                return w(mb, grads)
            stash.weight_grads = logged
        backward = runner.backward

        def noted(mb, chunk, *rest):
            backs.add((mb, chunk))
            return backward(mb, chunk, *rest)
        runner.backward = noted
        pm.forward_backward(runner, schedule_actions(schedule, pos, 4), x, y, 4)
        assert sorted(ran) == sorted((mb, c) for mb in range(4) for c in split), (schedule, ran)


# ----------------------------------------------------------------------------- zbv: zero bubble in a V


@pytest.mark.parametrize("stages,microbatches,extra", [(3, 4, []), slow(2, 6, ["--recompute"]), slow(4, 2, [])])
def test_zbv_equals_the_baseline_with_dropout_and_clipping(tmp_path, baseline, stages, microbatches, extra):
    """Two chunks per rank in a V: rank 0 reads the inputs and the labels and logs the loss; rank p-1
    hands its chunk 0's output to its chunk 1 in place. Losses and gradient norms are the baseline's."""
    args = MLP + ["--steps", "10", "--dropout", "0.1", "--clip-grad-norm", "0.15"]   # clips most steps
    run = launch("pipeline_microbatch.py", args + extra + ["--schedule", "zbv", "--microbatches", str(microbatches)],
                 tmp_path, nproc=stages)
    base = baseline(args)
    assert_same_losses(run, base)
    norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(run.events("train"), base.events("train"), strict=True)]
    assert max(abs(a - b) for a, b in norms) < 1e-4 and sum(b > 0.15 for _, b in norms) >= len(norms) // 2, norms


def test_zbv_check_compares_every_tensor_with_the_full_model(tmp_path):
    run = launch("pipeline_microbatch.py", MLP + ["--check", "--schedule", "zbv", "--microbatches", "4", "--dropout",
                                                  "0.1", "--clip-grad-norm", "1"], tmp_path, nproc=2)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("all tensors match the full model") == 1, run.stdout
