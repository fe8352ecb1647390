"""The point-to-point plumbing of pipeline_microbatch.Messenger that a student may skip: waits that
give up after --timeout-s with an error naming the message, and receives posted ahead on gloo.

Receives posted ahead. A gloo send completes one of two ways. If its receive is already posted, the
sender's own thread writes the data at once, inside isend. If not, the send waits for the receiver's
notice, and gloo's I/O thread writes it when the notice comes: on busy cores, a thread that must first
wait for one (single posts of up to 10 ms measured on 2 cores, docs/benchmarks.md). So on gloo each
exchange also posts the receives of the next EXCHANGES_AHEAD exchanges, and a message's receive is
usually waiting before its send is posted. The schedule is unchanged: each receive is still waited for
in its own exchange, and the receives go out in the schedule's order (what untagged matching pairs by).

Never on nccl: there a posted receive holds back every later operation on nccl's stream, the sends
that its sender is waiting for included, a deadlock. The Messenger gives nccl 0 exchanges ahead.

zbv's sends at once, on gloo (sends_at_once). zbv's plan (mp.pp.schedules.rendezvous) holds a send
back until the tick the clock table says its receiver reads it, which keeps it deadlock-free with
sends that block, as on nccl's stream; but a receiver running ahead of the table then waits for it
(1-1.5 ms an exchange, measured on 2 cores). On gloo nothing forces that: the executor there posts
each zbv send in the exchange right after its compute (schedule_actions(..., sends_at_once=True)) and waits
for its sends only at the step's end, so a send never blocks and no cycle can form (dry_run with
blocking_sends=False plays every plan of p 2-8, m 1-16 to its end; with blocking sends the same plan
deadlocks, tests/test_schedules.py). The cost: a zbv step keeps each sent tensor until its end, one
microbatch's boundary tensor per message, where the other schedules free it an exchange later.

Sends kept in flight, on nccl (sends_kept). There waiting for a send does not block the CPU: it makes
the compute stream wait until the peer has received it. Waited before the next exchange that sends, as
on gloo, it would hold each stage's kernels in lock step with its neighbour's receives. So on cuda the
Messenger leaves the newest SENDS_KEPT sends in flight at each exchange that sends and waits for the
rest, and for all of them at the step's end. Waiting later only removes dependencies from the compute
stream, so no deadlock can come of it; the cost is at most SENDS_KEPT sent tensors held a little longer.
Reasoned only: no two nccl ranks have run yet (docs/gpu.md).

Measured on 2 stages and 2 cores, in one pair of processes (benchmarks/zero_bubble.py --paired-ahead,
docs/benchmarks.md, Overheads): receives ahead took 1F1B's step to 0.98-0.99 of what it
was; both changes took zbv's to 0.87-0.91 of the old 1F1B's, where the old zbv's was 0.96.
"""
import datetime

import torch.distributed as dist

from mp.errors import CommError

# covers a whole step of 1F1B or zbv at m = 8 on 2 stages, and bounds what a stage holds before its
# time at 16 receive buffers (one microbatch's boundary tensor each), not one per microbatch of the step
EXCHANGES_AHEAD = 16

# nccl: sends a stage leaves in flight when it next sends (16 boundary tensors at most, as above)
SENDS_KEPT = 16


def nccl_rules(device):
    """Do this rank's messages take nccl's paths (below: no receive posted ahead, sends kept in flight,
    zbv's sends held back to their tick)? On a GPU. tests/nccl_rule.py makes it true on the CPU, to run
    those paths on gloo with every send and receive checked to be inside a batch."""
    return device.type == "cuda"


def sends_at_once(schedule, device):
    """Does this run post zbv's sends right after their compute and wait for them at the step's end?
    zbv on gloo (the CPU) only."""
    return schedule == "zbv" and not nccl_rules(device)


def sends_kept(device):
    """How many of its newest sends the Messenger leaves in flight when it next sends: on nccl, where a
    wait makes the compute stream wait for the peer, SENDS_KEPT; on gloo none (a send whose receive is
    posted ahead is done already; zbv waits for its sends at the step's end)."""
    return SENDS_KEPT if nccl_rules(device) else 0


def wait_sends(sending, keep, wait):
    """Wait for the sends in flight, (work, tensor, part) oldest first, but the newest `keep`; returns
    those. wait(work, parts) waits for one; then its tensor may go (a work of None is done already)."""
    done, kept = sending[:len(sending) - keep], sending[len(sending) - keep:]
    for work, _, part in done:
        if work is not None:
            wait(work, [part])
    return kept


def receives_ahead(actions, k):
    """{index of an exchange in actions: the receives of the k exchanges after it}, in their order."""
    exchanges = [i for i, action in enumerate(actions) if action[0] == "comm"]
    return {i: [part for j in exchanges[n + 1:n + 1 + k] for part in actions[j][1] if part[0] == "recv"]
            for n, i in enumerate(exchanges)}


class EarlyReceives:
    """One rank's receives posted before their exchange: message -> (op, work). On gloo only: nccl
    posts none (a receive posted alone there holds back the sends behind it on the stream)."""

    def __init__(self, exchanges_ahead, device):
        self.k, self.posted = 0 if nccl_rules(device) else exchanges_ahead, {}

    def plan(self, actions):
        """What each exchange of a step's actions posts ahead (nothing when k is 0: nccl)."""
        return receives_ahead(actions, self.k) if self.k else {}

    def take(self, parts):
        """{part: (op, work)} for the parts of an exchange already posted ahead; they are its own now."""
        return {part: self.posted.pop(part[2]) for part in parts if part[2] in self.posted}

    def post(self, parts, make_op):
        """Post these receives now, each alone (a receive crosses nothing), unless posted already.
        make_op(kind, peer, message) -> the receive's P2POp, with its buffer and tag."""
        for kind, peer, msg in parts:
            if msg not in self.posted:
                op = make_op(kind, peer, msg)
                self.posted[msg] = (op, dist.irecv(op.tensor, op.peer, op.group, op.tag))


class PipelineError(CommError):              # mp.dist.distributed() prints it as one error: line
    pass


def wait_message(work, parts, device, timeout_s, stage):
    """gloo: block the CPU, at most timeout_s, then a PipelineError naming the messages (parts) that
    stage waited for. nccl: order my stream after the message and let the CPU queue on (no timeout:
    with one, nccl's wait spins the CPU); a hang is caught by the loop's one bounded wait, its read of
    the logged steps (mp.loop), which names the step."""
    if device.type == "cuda":
        work.wait()
        return
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        wanted = ", ".join(f"{k} the {'activation' if m[0] == 'act' else 'gradient'} of microbatch "
                           f"{m[1]} {'from' if k == 'recv' else 'to'} rank {peer}" for k, peer, m in parts)
        raise PipelineError(f"stage {stage} waited to {wanted} and gave up (timeout "
                            f"{timeout_s:g} s): {str(e).splitlines()[0][:160]}") from None
