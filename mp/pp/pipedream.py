"""PipeDream-2BW's two weight versions (Narayanan et al. 2021, "Memory-efficient pipeline-parallel
DNN training"): the pipeline is never flushed, so the next batch's first forwards run before this
batch's gradient exists. 2BW gives every microbatch of batch t the same 1-stale weights, on every
stage, and applies its gradient to the newest ones:

    W(t+1) = W(t) - lr * grad f_t(W(t-1))          (momentum as usual; W(-1) = W(0))

Stage r, during step t (schedules.py's 2bw), runs batch t's remaining forwards and all its
backwards with W(t-1), and the first p-r-1 forwards of batch t+1 with W(t). So it holds two
versions, and both are needed until batch t's last backward:

    older  W(t-1): batch t's forwards and backwards (weight stashing: a backward uses the weights
                   of its own forward); its tensors collect batch t's gradient
    newer  W(t):   batch t+1's early forwards

Once batch t's backwards are done W(t-1) is free, and its buffer takes the new version: copy W(t)
into it, then let the optimizer step it to W(t+1) with batch t's gradient. The buffers then swap
roles (W(t) is batch t+1's older), and the optimizer's momentum moves to the buffer it will step
next. Two copies of the weights, never three; single_baseline.py --delay 1 is the same rule in
one process.

A checkpoint after step t holds W(t+1), W(t) (as stale/...) and the momentum, in the baseline's
coordinates like every checkpoint (mp.checkpoint), so 2bw and --delay 1 resume from each other's in
any layout. The next batch's forwards that were in flight are not saved: the resumed first step
warms up again, and runs them with the same W(t+1).
"""
import torch
from torch.func import functional_call

from mp.data import next_batch
from mp.pp.schedules import schedule_actions


class TwoVersions:
    """One stage's two weight versions, per chunk (the modules' own parameters start as one, a copy as
    the other), handed to pipeline_microbatch.py's StageRunner as its `versions`, the strategy it asks
    which weights a forward runs with, what the optimizer steps, and what a step carries over.

    A step's action list (schedules.py's 2bw) numbers this batch's microbatches 0..m-1 and the next
    batch's first ones m, m+1, ...: those run on the newer version, draw the next step's dropout
    masks, and what they leave (saved activations, received messages) is carried into the next step,
    renumbered from 0."""

    def __init__(self, chunks, pos, m, steps, model):
        self.chunks, self.pos, self.m, self.steps = chunks, pos, m, steps
        self.names = [[name for name, _ in chunk.named_parameters()] for chunk in chunks]
        self.older = [[p for _, p in chunk.named_parameters()] for chunk in chunks]
        self.newer = [[p.detach().clone().requires_grad_() for p in ps] for ps in self.older]
        # where each module parameter's two versions sit (the buffers swap roles every step)
        slot = {id(p): (c, j) for c, ps in enumerate(self.older) for j, p in enumerate(ps)}
        self.slots = [(name, slot[id(p)]) for name, p in model.named_parameters()]   # model: named as the full one
        self.weights = []                     # what a checkpoint holds: kept up to date by step()
        self.checkpointed()
        self.carried = ({}, {})               # the next batch's saved activations and received messages
        self.warm = False                     # has a step left the next batch's forwards in flight?

    def actions(self, step):
        """This step's action list: the first step this process trains (the run's first, or the first
        after a resume) warms up, the last drains, the others do neither."""
        return schedule_actions("2bw", self.pos, self.m, first=not self.warm, last=step == self.steps - 1)

    def checkpointed(self):
        """For checkpoints (mp.checkpoint): (name, W(t+1), W(t), the tensor the optimizer steps) per
        parameter of the model, between steps; the same list object, refilled after each swap."""
        self.weights[:] = [(name, self.newer[c][j], self.older[c][j], self.older[c][j]) for name, (c, j) in self.slots]

    def carry_in(self, training):
        """What the last step left in flight, as this step's (saved, inbox). An evaluation between
        steps starts empty and leaves the carried work be."""
        if not training:
            return {}, {}
        carried, self.carried = self.carried, ({}, {})
        return carried

    def carry_out(self, saved, inbox, training):
        """Keep the next batch's work, renumbered from 0 (keys (..., microbatch, chunk or stage))."""
        if not training:
            assert not saved and not inbox, "the evaluation left work behind"
            return
        self.carried = tuple({key[:-2] + (key[-2] - self.m, key[-1]): value for key, value in kept.items()}
                             for kept in (saved, inbox))
        self.warm = True

    def batch_of(self, mb, step):
        """(microbatch, step) whose dropout masks mb draws: the next batch's mb - m draws step + 1's."""
        return (mb, step) if mb < self.m or step is None else (mb - self.m, step + 1)

    def run(self, chunk, x, mb, training):
        """The chunk's forward with the version of mb's batch (an evaluation: the newest) in place of
        its parameters."""
        tensors = (self.newer if mb >= self.m or not training else self.older)[chunk]
        return functional_call(self.chunks[chunk], dict(zip(self.names[chunk], tensors)), (x,))

    def trained(self):
        """The tensors this step's backwards differentiate (W(t-1)): the optimizer steps these."""
        return [p for ps in self.older for p in ps]

    def held(self):
        """Both versions: what this stage holds of the model's weights."""
        return [p for ps in self.older + self.newer for p in ps]

    def step(self, optimizer):
        """After batch t's last backward: W(t+1) into W(t-1)'s buffer, then swap the roles."""
        older, newer = self.trained(), [p for ps in self.newer for p in ps]
        with torch.no_grad():
            for o, n in zip(older, newer):
                o.copy_(n)                    # W(t); o.grad is still batch t's gradient at W(t-1)
        optimizer.step()                      # W(t+1) = W(t) - lr * (momentum of) that gradient
        for o in older:
            o.grad = None
        self.older, self.newer = self.newer, self.older
        self.checkpointed()
        state = optimizer.state               # the momentum follows the buffer stepped next time
        for now, nxt in zip(older, newer):
            if now in state:
                state[nxt] = state.pop(now)
        optimizer.param_groups[0]["params"] = newer


def pipedream_inputs(x, data, step, args, pos, replica, device):
    """2bw's first stage: this batch's microbatches, then the next batch's, whose first forwards
    run in this step (each batch is drawn twice there: as the next one, then as this one)."""
    m, ahead = args.microbatches, step + 1 < args.steps
    upcoming = next_batch(data, step + 1, args, pos, device, replica)[0].chunk(m) if ahead else []
    return list(x.chunk(m)) + list(upcoming)
