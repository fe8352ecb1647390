"""nccl's matching rule, checked on the schedules as data: nccl ignores tags and matches the
point-to-point messages between two ranks in the order they are posted. So for every ordered pair
of ranks (a, b), the messages a posts as sends to b must come in exactly the order in which b
posts its receives from a. gloo matches by tag and would forgive another order; nccl would pair an
activation with the wrong buffer (or a gradient of another shape) and compute garbage or hang.
Messenger.exchange posts each action's parts in their listed order, which is what is read here.

The second half checks the same by running: the executors on gloo with every message's tag 0, so
gloo too can only pair messages in posting order, as nccl does (one GPU here cannot host several
nccl ranks). Every schedule must then give exactly the losses, gradient norms, gradients, weights
and evaluation of the tagged run; a rank whose sends go out in another order than its peer
receives them gets the wrong tensors (garbage numbers, a shape error or a timeout error line)."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

import pipeline_microbatch as pm
from helpers import FAST, assert_same_losses, launch, run_ranks, slow
from mp.data import SyntheticData
from mp.pp.tied import tie_embeddings
from mp.dist import Env
from mp.optim import make_optimizer
from mp.pp.evaluate import evaluate_pipeline
from mp.pp.schedules import SCHEDULES, eval_actions, placement_of, schedule_actions
from mp.pp.timeline import Timeline


def posting_orders(all_actions):
    """{(sender, receiver): [message, ...]} as sent, and the same as received, in posting order."""
    sent, received = {}, {}
    for rank, actions in enumerate(all_actions):
        for action in actions:
            if action[0] != "comm":
                continue
            for kind, peer, msg in action[1]:
                pair = (rank, peer) if kind == "send" else (peer, rank)
                (sent if kind == "send" else received).setdefault(pair, []).append(msg)
    return sent, received


def assert_same_order(all_actions, what):
    sent, received = posting_orders(all_actions)
    assert sent.keys() == received.keys(), what
    for pair in sent:
        assert sent[pair] == received[pair], f"{what}: rank {pair[0]} sends to rank {pair[1]} in another order " \
                                             f"than it receives: {sent[pair]} against {received[pair]}"


def ranks(p, v, schedule="1f1b"):
    return [pm.PipelineRank(r, p, list(range(p)), v, placement=placement_of(schedule)) for r in range(p)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_posts_sends_in_the_order_the_peer_posts_receives(schedule):
    cases = 0
    for p in range(2, 7):
        for m in range(1, 13):
            for v in ((2, 3) if schedule == "interleaved" else (2,) if schedule == "zbv" else (1,)):
                if schedule == "interleaved" and m % p or schedule == "2bw" and m < p:
                    continue
                assert_same_order([schedule_actions(schedule, pos, m) for pos in ranks(p, v, schedule)],
                                  f"{schedule}, p={p}, m={m}, v={v}")
                cases += 1
    assert cases >= 20


def test_2bw_posts_in_matching_order_across_step_boundaries():
    """2bw's steps run into each other (the next batch's first forwards, the receive posted at the
    end of the step before): the order holds over whole runs of several steps."""
    cases = 0
    for p in range(2, 6):
        for m in range(p, p + 5):
            for steps in (2, 3, 5):
                runs = [[a for t in range(steps) for a in schedule_actions("2bw", pos, m, first=t == 0,
                                                                              last=t == steps - 1)]
                        for pos in ranks(p, 1)]
                assert_same_order(runs, f"2bw, p={p}, m={m}, {steps} steps")
                cases += 1
    assert cases >= 40


@pytest.mark.parametrize("p,v,n,schedule", [(2, 1, 3, "1f1b"), (4, 1, 5, "1f1b"), (3, 2, 4, "interleaved"),
                                            (4, 2, 1, "interleaved"), (3, 2, 4, "zbv"), (2, 2, 3, "zbv")])
def test_evaluation_posts_sends_in_the_order_the_peer_posts_receives(p, v, n, schedule):
    assert_same_order([eval_actions(pos, n) for pos in ranks(p, v, schedule)], f"evaluation, p={p}, v={v}, {n} batches")


def test_the_check_can_fail():
    """Swapping two of one rank's sends to the same peer is caught."""
    actions = [schedule_actions("1f1b", pos, 4) for pos in ranks(2, 1)]
    comms = [i for i, a in enumerate(actions[0]) if a[0] == "comm" and any(k == "send" for k, _, _ in a[1])]
    first, second = comms[0], comms[1]
    actions[0][first], actions[0][second] = actions[0][second], actions[0][first]
    with pytest.raises(AssertionError, match="another order"):
        assert_same_order(actions, "swapped")


# --- by running: gloo with every tag 0 ----------------------------------------------------------

MLP = FAST + ["--model", "mlp", "--hidden", "32", "--layers", "8", "--batch-size", "24",
              "--timeout-s", "10"]  # a pairing gone wrong shows in seconds, not the default minutes
CASE = "TEST_NCCL_ORDER_CASE"         # how a test hands its case to the ranks (they inherit the environment)
QUICK = [("gpipe", 3), ("1f1b", 4), ("interleaved", 2), ("zb", 3), ("zbv", 3), ("2bw", 2)]   # one of each, not slow


def microbatch_counts(schedule, p):
    """A few m per schedule at p stages: fewer than p, p and more where the schedule takes them."""
    if schedule == "interleaved":
        return (p, 2 * p)                 # a multiple of the stages
    if schedule == "2bw":
        return (p, 6)                     # at least the stages
    return tuple(sorted({1, p, 6}))


@pytest.mark.parametrize("schedule,p", QUICK + [slow(s, p) for s in SCHEDULES for p in (2, 3, 4) if (s, p) not in QUICK])
def test_every_schedule_runs_on_gloo_with_all_tags_zero(tmp_path, monkeypatch, schedule, p):
    """Two steps (2bw: three, its first, a middle and its last) and an evaluation per m, tagged and
    untagged: the same numbers, bit for bit."""
    monkeypatch.setenv(CASE, json.dumps([schedule, microbatch_counts(schedule, p), False]))
    run_ranks(_untagged_case, p, tmp_path)


def test_sends_swapped_on_one_rank_fail_without_tags_and_pass_with_them(tmp_path, monkeypatch):
    """The test above can fail: rank 0 posts two sends to rank 1 (an activation and a gradient of the
    same shape, in one exchange of interleaved 1F1B) in the other order than rank 1 posts their
    receives. With tags gloo pairs them anyway and nothing changes; with tag 0 each lands in the
    other's buffer, as on nccl, and the numbers differ."""
    monkeypatch.setenv(CASE, json.dumps(["interleaved", [4], True]))
    with pytest.raises(Exception) as failure:   # AssertionError; TESTS_LAUNCHER=torchrun: spawn's ProcessRaisedException
        run_ranks(_untagged_case, 2, tmp_path)
    assert "swapped, without tags" in str(failure.value), str(failure.value)[-3000:]
    assert ", with tags" not in str(failure.value), str(failure.value)[-3000:]   # that half passed


def _untagged_case(rank, world, group):
    schedule, counts, swap = json.loads(os.environ[CASE])
    for m in counts:
        reference = play(schedule, m, rank, world)
        if swap:   # gloo's tags forgive the swap: that is the rule this file checks
            same(play(schedule, m, rank, world, swap=True), reference, f"{schedule}, p={world}, m={m}, swapped, with tags")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pm.Messenger, "tag", lambda self, msg: 0)
            got = play(schedule, m, rank, world, swap=swap)
        same(got, reference, f"{schedule}, p={world}, m={m}{', swapped' if swap else ''}, without tags")


def play(schedule, m, rank, world, swap=False):
    """Training steps and one evaluation of pipeline_microbatch.py's executor, as its main() runs them
    (pm.train_step on its schedule). Returns what each rank can compare."""
    steps = "3" if schedule == "2bw" else "2"
    args = pm.parse_args(MLP + ["--schedule", schedule, "--microbatches", str(m), "--steps", steps])
    env = Env(rank, world, rank, world, "gloo", torch.device("cpu"))
    pos = pm.PipelineRank(rank, world, list(range(world)), args.virtual_stages, placement=placement_of(schedule))
    model, runner = pm.setup_stage(args, env, pos)
    tie_embeddings(args, model, runner, SimpleNamespace(groups={}))   # as main() does (the mlp: nothing tied)
    actions = (swapped_sends if swap and rank == 0 else schedule_actions)(args.schedule, pos, args.microbatches)
    optimizer, data = make_optimizer(runner.parameters(), args), SyntheticData(args.seed, test_size=700)
    timeline = Timeline(args, runner, pos, owner=False)
    # (the last stage's loss, else None; this rank's sum of squared gradients: without clipping no collective)
    steps = [(loss if loss is None else loss.item(), squares.item())
             for loss, squares in (pm.train_step(k, runner, optimizer, actions, data, args, timeline)
                                   for k in range(args.steps))]
    held = runner.versions.held() if runner.versions else runner.parameters()   # 2bw: both weight versions
    return dict(steps=steps, grads=[p.grad for p in held], weights=[p.detach() for p in held],
                evaluation=evaluate_pipeline(runner, pos, data, env.device).tolist())


def swapped_sends(*args, **kwargs):
    """schedule_actions with the parts of the first exchange that sends twice to one peer reversed."""
    actions = schedule_actions(*args, **kwargs)
    for i, action in enumerate(actions):
        sends = [part for part in action[1] if part[0] == "send"] if action[0] == "comm" else []
        if len(sends) == 2 and sends[0][1] == sends[1][1]:
            actions[i] = ("comm", sends[::-1] + [part for part in action[1] if part[0] != "send"])
            return actions
    raise AssertionError("no exchange sends twice to one peer")


def same(got, want, what):
    """Bit for bit: the schedule's arithmetic is the same; only the pairing of messages could differ."""
    assert got["steps"] == want["steps"], f"{what}: (loss, squared gradients) per step {got['steps']} != {want['steps']}"
    assert got["evaluation"] == want["evaluation"], f"{what}: evaluation {got['evaluation']} != {want['evaluation']}"
    for kind in ("grads", "weights"):
        for i, (a, b) in enumerate(zip(got[kind], want[kind], strict=True)):
            if a is None or b is None:    # 2bw's update drops the gradients (its norm is compared)
                assert a is b, f"{what}: {kind} of parameter {i}: one is None"
                continue
            assert torch.equal(a, b), f"{what}: {kind} of parameter {i} differ by {(a - b).abs().max():.3g}"


# --- by running: each program on its nccl paths, every send and receive inside a batch -----------

SMALL = FAST + ["--steps", "3", "--timeout-s", "20"]
PIPE = SMALL + ["--model", "mlp", "--hidden", "32", "--layers", "6", "--batch-size", "24"]
VIT = SMALL + ["--model", "vit", "--layers", "3", "--hidden", "32", "--batch-size", "8", "--dropout", "0.1"]
SENDERS = [  # (program, its flags, the baseline's flags beyond the shared ones, ranks)
    slow("pipeline_microbatch.py", ["--schedule", "1f1b", "--microbatches", "4", "--eval-every", "2"], [], 2),
    slow("pipeline_microbatch.py", ["--schedule", "zbv", "--microbatches", "4"], [], 2),
    ("context_parallel.py", ["--attention", "ring", "--eval-every", "2"], [], 2),
    slow("pipeline_microbatch.py", ["--schedule", "gpipe", "--microbatches", "4"], [], 3),
    slow("pipeline_microbatch.py", ["--schedule", "interleaved", "--microbatches", "4"], [], 2),
    slow("pipeline_microbatch.py", ["--schedule", "zb", "--microbatches", "4", "--recompute"], [], 3),
    slow("pipeline_microbatch.py", ["--schedule", "2bw", "--microbatches", "4"], ["--delay", "1"], 2),
    slow("pipeline_dp_joint.py", ["--dp", "2", "--microbatches", "2", "--schedule", "1f1b"], [], 4),
    slow("parallel_3d.py", ["--dp", "1", "--tp", "2", "--microbatches", "2"], [], 4),
    slow("context_parallel.py", ["--attention", "ring"], [], 4),
]


@pytest.mark.parametrize("program,extra,reference,nproc", SENDERS)
def test_every_program_that_sends_messages_batches_them_as_nccl_requires(tmp_path, monkeypatch, baseline,
                                                                        program, extra, reference, nproc):
    """tests/nccl_rule.py runs the program on the paths it takes on nccl (mp.pp.p2p.nccl_rules) with
    dist.isend and dist.irecv refused outside dist.batch_isend_irecv, and one Work a batch, as nccl
    returns: it must send through batches, and log the baseline's losses that way. Before issue 57 the
    context-parallel ring posted an irecv, then an isend, each alone, and hung on nccl; here it stops
    with the rule's error."""
    args = (VIT if program == "context_parallel.py" else PIPE) + extra
    monkeypatch.setenv("NCCL_RULE_PROGRAM", program)
    monkeypatch.setenv("NCCL_RULE_DIR", str(tmp_path))
    run = launch("tests/nccl_rule.py", args, tmp_path, nproc=nproc, log_name="run.jsonl", timeout=120)
    assert "nccl rule" not in run.stderr and run.returncode == 0, run.stderr[-3000:]
    assert_same_losses(run, baseline((VIT if program == "context_parallel.py" else PIPE) + reference))
    for rank in range(nproc):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert seen["batches"] > 0 and seen["batched_ops"] >= seen["batches"], (rank, seen)
