"""nccl's matching rule, checked on the schedules as data: nccl ignores tags and matches the
point-to-point messages between two ranks in the order they are posted. So for every ordered pair
of ranks (a, b), the messages a posts as sends to b must come in exactly the order in which b
posts its receives from a. gloo matches by tag and would forgive another order; nccl would pair an
activation with the wrong buffer (or a gradient of another shape) and compute garbage or hang.
Messenger.exchange posts each action's parts in their listed order, which is what is read here."""
import pytest

import pipeline_microbatch as pm
from mp.pp.schedules import SCHEDULES, eval_actions, schedule_actions


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


def ranks(p, v):
    return [pm.PipelineRank(r, p, list(range(p)), v) for r in range(p)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_posts_sends_in_the_order_the_peer_posts_receives(schedule):
    cases = 0
    for p in range(2, 7):
        for m in range(1, 13):
            for v in ((2, 3) if schedule == "interleaved" else (1,)):
                if schedule == "interleaved" and m % p or schedule == "2bw" and m < p:
                    continue
                assert_same_order([schedule_actions(schedule, pos, m) for pos in ranks(p, v)],
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


@pytest.mark.parametrize("p,v,n", [(2, 1, 3), (4, 1, 5), (3, 2, 4), (4, 2, 1)])
def test_evaluation_posts_sends_in_the_order_the_peer_posts_receives(p, v, n):
    assert_same_order([eval_actions(pos, n) for pos in ranks(p, v)], f"evaluation, p={p}, v={v}, {n} batches")


def test_the_check_can_fail():
    """Swapping two of one rank's sends to the same peer is caught."""
    actions = [schedule_actions("1f1b", pos, 4) for pos in ranks(2, 1)]
    comms = [i for i, a in enumerate(actions[0]) if a[0] == "comm" and any(k == "send" for k, _, _ in a[1])]
    first, second = comms[0], comms[1]
    actions[0][first], actions[0][second] = actions[0][second], actions[0][first]
    with pytest.raises(AssertionError, match="another order"):
        assert_same_order(actions, "swapped")
