"""Data-parallel gradients in flat buckets, each one's collective started as soon as its gradients are
final, so that the communication overlaps the rest of the backward (DDP's idea, written out).

Each parameter's .grad is a view into one flat bucket (a bucket holds consecutive parameters in the
order backward finishes them: the last layers first), so a bucket goes to the collective as it is:
no copy in, no copy out. A post-accumulate hook counts each parameter's accumulations in the step; a
pipeline accumulates once per microbatch, and zero-bubble's W accumulates the weights later than B
does the rest, so how many make a gradient final is counted in the first step (which starts every
collective after its backward, as a plain all-reduce would) and expected from then on. When the last
parameter of a bucket is final, the bucket's collective starts (async_op=True) and the backward goes
on; wait() waits for all of them just before the optimizer step.

    backward of the last microbatch:   [ layer 8 | layer 7 | layer 6 | ... | layer 1 ]
    bucket 0 (layers 8-6):                       all-reduce ------>
    bucket 1 (layers 5-1):                                           all-reduce --->   wait, step

Every replica runs the same schedule on the same stage, so the hooks fire in the same order on each,
and the buckets' collectives are started in the same order on every rank of the group (gloo and
nccl need that). shard=True (--zero 1, mp.zero): each bucket is padded to a multiple of the group's
size and reduce-scattered, so each replica receives the sum of its 1/D of every bucket only.
"""
import time

import torch
import torch.distributed as dist

from mp.dist import awaiting, buckets

# torch 2.14 renamed reduce_scatter_tensor and all_gather_into_tensor (the old names warn); either works
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
BUCKET_MB = 4   # small enough that a few-MB stage gets several buckets to overlap; DDP's first is 1 MB


class Bucket:
    """Consecutive parameters' gradients in one flat tensor (padded to a multiple of `parts` when sharded)."""

    def __init__(self, params, parts, device):
        self.params, self.offsets = params, []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel, self.parts = n, parts
        self.grad = torch.zeros(-(-n // parts) * parts, dtype=params[0].dtype, device=device)
        self.views = [self.grad[o:o + p.numel()].view_as(p) for p, o in zip(params, self.offsets)]
        self.work, self.ready = None, 0

    def hold_params(self):
        """--zero 1: the parameters' data become views into one flat tensor too, so that an all-gather
        writes every replica's updated slice into them directly (the values are kept)."""
        self.param = torch.zeros_like(self.grad)
        for p, o in zip(self.params, self.offsets):
            self.param[o:o + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.param[o:o + p.numel()].view_as(p)

    def segments(self, rank):
        """[(parameter, its first element in my shard, in the parameter, how many)]: the pieces of the
        parameters that my shard of this bucket holds."""
        size = self.grad.numel() // self.parts
        lo, hi, out = rank * size, (rank + 1) * size, []
        for p, o in zip(self.params, self.offsets):
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                out.append((p, a - lo, a - o, b - a))
        return out

    def shard(self, tensor, rank):
        """My 1/parts of a flat tensor of this bucket's (padded) size."""
        size = tensor.numel() // self.parts
        return tensor[rank * size:(rank + 1) * size]


class GradBuckets:
    """The gradients of params, summed over `group` and divided by its size (the replicas' mean) in
    flat buckets started during the backward. waiting: (what, timeout_s) for mp.dist.awaiting.
    recorder: the pipeline runner, whose timeline (when it records) gets each collective's span."""

    def __init__(self, params, group, waiting, shard=False, bucket_mb=BUCKET_MB, recorder=None, late=()):
        params = [p for p in params if p.requires_grad][::-1]   # backward finishes the last layers first
        # late: gradients that other ranks' sums complete after the backward (wait's `before`): their
        # buckets start only then, or the sum would race the collective on the same memory
        self.late = {id(p) for p in late}
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.waiting, self.sharded, self.recorder = waiting, shard, recorder
        device = params[0].device if params else torch.device("cpu")
        self.buckets = [Bucket(ps, self.size if shard else 1, device) for ps in buckets(params, bucket_mb * 2**20)]
        self.where = {id(p): b for b in self.buckets for p in b.params}
        self.counts, self.expected = {}, None        # accumulations in this step; per step (after the first)
        for p in params:
            p.register_post_accumulate_grad_hook(self.accumulated)
        self.shard_grads = [torch.zeros(b.grad.numel() // self.size, dtype=b.grad.dtype, device=device)
                            for b in self.buckets] if shard else None
        if shard:
            for b in self.buckets:
                b.hold_params()

    def zero_grad(self):
        """Before a step's first backward: zero buckets, and each .grad a view into its bucket again (an
        optimizer's zero_grad(set_to_none=True) would drop the views)."""
        for b in self.buckets:
            b.grad.zero_()
            b.work, b.ready = None, 0
            for p, view in zip(b.params, b.views):
                p.grad = view
        self.counts = {}

    def accumulated(self, p):
        self.counts[id(p)] = self.counts.get(id(p), 0) + 1
        if self.expected is not None and self.counts[id(p)] == self.expected.get(id(p)) and id(p) not in self.late:
            b = self.where[id(p)]
            b.ready += 1
            if b.ready == len(b.params):
                self.start(b)

    def start(self, b):
        """The bucket's collective, without waiting for it."""
        if self.size == 1:
            return
        if self.sharded:
            b.work = REDUCE_SCATTER(self.shard_grads[self.buckets.index(b)], b.grad, group=self.group, async_op=True)
        else:
            b.work = dist.all_reduce(b.grad, group=self.group, async_op=True)
        events = getattr(self.recorder, "events", None)
        if events is not None:   # the timeline: from the start to the end of the collective, on its own row
            start, name = time.perf_counter(), f"{'reduce-scatter' if self.sharded else 'all-reduce'} {self.buckets.index(b)}"
            b.work.get_future().add_done_callback(
                lambda _: events.append(("collective", name, None, 0, start, time.perf_counter())))

    def wait(self, before=None):
        """After the step's last backward: run before() (the late gradients' sums), start what the hooks
        did not (the first step: all), wait for every bucket, divide by the group's size. Afterwards
        each .grad (unsharded), or each replica's shard_grads (sharded), is the mean over the replicas."""
        if self.expected is None:
            self.expected = dict(self.counts)
        if before is not None:
            before()
        for b in self.buckets:
            if b.work is None:
                self.start(b)
        with awaiting(*self.waiting):
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
        for b, flat in zip(self.buckets, self.shard_grads if self.sharded else [b.grad for b in self.buckets]):
            if self.size > 1:
                flat /= self.size
