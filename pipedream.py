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
coordinates like every checkpoint (checkpoint.py), so 2bw and --delay 1 resume from each other's in
any layout. The next batch's forwards that were in flight are not saved: the resumed first step
warms up again, and runs them with the same W(t+1).
"""
import torch
from torch.func import functional_call

from data import next_batch
from pipeline_microbatch import StageRunner
from schedules import schedule_actions


class TwoVersions:
    """One stage's two weight versions, per chunk: the modules' own parameters start as one, a
    copy as the other."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.names = [[name for name, _ in chunk.named_parameters()] for chunk in chunks]
        self.older = [[p for _, p in chunk.named_parameters()] for chunk in chunks]
        self.newer = [[p.detach().clone().requires_grad_() for p in ps] for ps in self.older]
        # where each module parameter's two versions sit (the buffers swap roles every step)
        self.slot = {id(p): (c, j) for c, ps in enumerate(self.older) for j, p in enumerate(ps)}

    def weights(self, model):
        """For checkpoints: (name, W(t+1), W(t), the tensor the optimizer steps) per parameter of
        model (named as in the full model), between steps."""
        slots = [(name, self.slot[id(p)]) for name, p in model.named_parameters()]
        return [(name, self.newer[c][j], self.older[c][j], self.older[c][j]) for name, (c, j) in slots]

    def run(self, chunk, x, newer):
        """The chunk's forward with one version's tensors in place of its parameters."""
        tensors = (self.newer if newer else self.older)[chunk]
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
        state = optimizer.state               # the momentum follows the buffer stepped next time
        for now, nxt in zip(older, newer):
            if now in state:
                state[nxt] = state.pop(now)
        optimizer.param_groups[0]["params"] = newer


class TwoVersionRunner(StageRunner):
    """pipeline_microbatch.py's executor for --schedule 2bw. A step's action list (schedules.py's
    2bw) numbers this batch's microbatches 0..m-1 and the next batch's first ones m, m+1, ...:
    those run on the newer version, draw the next step's dropout masks, and what they leave (saved
    activations, received messages) is carried into the next step, renumbered from 0."""

    def __init__(self, chunks, pos, messenger, m, recompute=False):
        super().__init__(chunks, pos, messenger, recompute=recompute)
        self.m, self.versions, self.carried = m, TwoVersions(chunks), ({}, {})
        self.warm = False                     # has a step left the next batch's forwards in flight?

    def step_actions(self, steps):
        """step -> its action list: the first step this process trains (the run's first, or the first
        after a resume) warms up, the last drains, the others do neither."""
        return lambda step: schedule_actions("2bw", self.pos, self.m, first=not self.warm, last=step == steps - 1)

    def checkpoint_weights(self):
        return self.versions.weights(self.model)

    def begin_batch(self, training):
        if not training:                      # an evaluation between steps leaves the carried work be
            return {}, {}
        carried, self.carried = self.carried, ({}, {})
        return carried

    def end_batch(self, saved, inbox, training):
        if not training:
            return super().end_batch(saved, inbox, training)
        self.carried = tuple({key[:-2] + (key[-2] - self.m, key[-1]): value for key, value in kept.items()}
                             for kept in (saved, inbox))   # keys (..., microbatch, chunk or stage)
        self.warm = True

    def key_masks_to(self, mb, step=None):
        if mb < self.m or self.step is None:
            return super().key_masks_to(mb)
        super().key_masks_to(mb - self.m, step=self.step + 1)   # the next batch's microbatch mb - m

    def call(self, chunk, mb, x, training):
        """The version of mb's batch (an evaluation: the newest)."""
        return self.versions.run(chunk, x, newer=mb >= self.m or not training)

    def parameters(self):
        return self.versions.trained()        # the older version: this step's backwards differentiate it

    def update(self, optimizer):
        self.versions.step(optimizer)         # the new version goes into the older's buffer


def pipedream_inputs(x, data, step, args, pos, replicas, device):
    """2bw's first stage: this batch's microbatches, then the next batch's, whose first forwards
    run in this step (each batch is drawn twice there: as the next one, then as this one)."""
    m, ahead = args.microbatches, step + 1 < args.steps
    upcoming = next_batch(data, step + 1, args, pos, replicas, device)[0].chunk(m) if ahead else []
    return list(x.chunk(m)) + list(upcoming)
