"""Data-parallel gradients in flat buckets, each one's collective started as soon as its gradients are
final, so that the communication overlaps the rest of the backward (DDP's idea, written out).

Each parameter's .grad is a view into one flat bucket (a bucket holds consecutive parameters in the
order backward finishes them: the last layers first), so a bucket goes to the collective as it is:
no copy in, no copy out. When a gradient is final is said, never inferred: the code that runs the
backward calls final(params) once it has run the last backward that touches them (the pipeline's
executor after a chunk's last B of the step and that B's Ws, or its last W under zero-bubble). When
every parameter of a bucket is final, the bucket's collective starts (async_op=True) and the backward
goes on; wait() waits for all of them just before the optimizer step.

    backward of the last microbatch:   [ layer 8 | layer 7 | layer 6 | ... | layer 1 ]
    bucket 0 (layers 8-6):                       all-reduce ------>
    bucket 1 (layers 5-1):                                           all-reduce --->   wait, step

A mistake here would be silent (a bucket summed before its last gradient arrived averages part of
the gradient), so it is made loud instead: a hook on each parameter notes a gradient that arrives
after its bucket started, and wait() stops with one error line naming the parameter, as it does for
a bucket that never started (a parameter never said final). The weights that zero-bubble's W writes
itself (in place, no autograd, so no hook would run) are `direct`: W reports them through arrived().

Every replica runs the same schedule on the same stage, so the buckets start in the same order on
every rank of the group (gloo and nccl need that). shard=True (--zero 1, mp.zero): each bucket is
padded to a multiple of the group's size and reduce-scattered, so each replica receives the sum of
its 1/D of every bucket only. free=True (--zero 2) goes one step further: once the reduce-scatters
are done, the whole buckets are let go, so that between the backward and the next step a replica
holds only its slices of the gradients (zero_grad() makes the whole buckets again, for the backward).
groups (--zero 3, mp.param_shards): one bucket per block, so that a block's weights are gathered and
freed as one flat tensor, the bucket its gradients are reduce-scattered in.

sent_bytes counts what this replica sends in the data-parallel collectives, as a ring moves them: an
all-reduce of n bytes over D replicas sends 2(D-1)/D n, a reduce-scatter or an all-gather (D-1)/D n
(the summary's dp_sent_mb_per_step; docs/optimizers.md compares it with the formula).
"""
import time

import torch
import torch.distributed as dist

from mp.dist import awaiting, buckets
from mp.errors import CommError

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
        self.padded, self.dtype, self.device = -(-n // parts) * parts, params[0].dtype, device
        self.make_grad()
        self.work, self.started, self.final = None, False, set()

    def make_grad(self):
        """The flat gradient, zeroed, and each parameter's view into it."""
        self.grad = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.views = [self.grad[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

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
        size = self.padded // self.parts
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


class BucketError(CommError):                # mp.dist.distributed() prints it as one error: line
    pass


class GradBuckets:
    """The gradients of params, summed over `group` and divided by its size (the replicas' mean) in
    flat buckets started during the backward. waiting: (what, timeout_s) for mp.dist.awaiting.
    recorder: the pipeline runner, whose timeline (when it records) gets each collective's span.
    late: gradients that other ranks' sums complete after the backward (parallel_3d.py's tensor-
    parallel sums): final() leaves them alone and final_late() says them final after those sums.
    direct: weights whose gradients our own code writes in place (zero-bubble's W): no hook on them."""

    def __init__(self, params, group, waiting, shard=False, bucket_mb=BUCKET_MB, recorder=None, late=(), direct=(),
                 free=False, groups=None):
        params = [p for p in params if p.requires_grad][::-1]   # backward finishes the last layers first
        self.late_ids = {id(p) for p in late}
        self.late = [p for p in params if id(p) in self.late_ids]
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.waiting, self.sharded, self.recorder = waiting, shard, recorder
        self.free = free and shard          # --zero 2, 3: the whole buckets exist from zero_grad() to wait() only
        device = params[0].device if params else torch.device("cpu")
        if groups is None:
            groups = buckets(params, bucket_mb * 2**20)
        else:                                         # given (--zero 3: a block each), the last block's first
            groups = [g for g in ([p for p in ps if p.requires_grad][::-1] for ps in groups[::-1]) if g]
        self.buckets = [Bucket(ps, self.size if shard else 1, device) for ps in groups]
        self.sent_bytes, self.unclocked = 0, []    # unclocked: (work, name, start) for the timeline
        self.where = {id(p): b for b in self.buckets for p in b.params}
        self.names = {}                               # id -> a name for error lines (name_params)
        self.too_late = None                          # the first gradient that arrived after its bucket started
        direct = {id(p) for p in direct}
        for p in params:
            if id(p) not in direct:
                p.register_post_accumulate_grad_hook(self.arrived)
        self.shard_grads = [torch.zeros(b.padded // self.size, dtype=b.dtype, device=device)
                            for b in self.buckets] if shard else None
        if shard:
            for b in self.buckets:
                b.hold_params()

    def name_params(self, named):
        """Name the parameters (named: [(name, p)]) for the error lines."""
        self.names.update({id(p): name for name, p in named})

    def zero_grad(self):
        """Before a step's first backward: zero buckets, and each .grad a view into its bucket again (an
        optimizer's zero_grad(set_to_none=True) would drop the views)."""
        for b in self.buckets:
            if b.grad is None:            # --zero 2 let it go after the last step's reduce-scatter
                b.make_grad()
            else:
                b.grad.zero_()
            b.work, b.started, b.final = None, False, set()
            for p, view in zip(b.params, b.views):
                p.grad = view
        self.too_late = None

    def arrived(self, p):
        """A gradient was added to p's (the hooks; zero-bubble's W calls it for the weights it writes)."""
        b = self.where.get(id(p))
        if b is not None and b.started and self.too_late is None:
            self.too_late = p

    def final(self, params):
        """The caller ran the last backward that touches these parameters in this step: start each bucket
        whose parameters are all final (the late ones wait for final_late())."""
        for p in params:
            b = self.where.get(id(p))
            if b is None or id(p) in self.late_ids:
                continue
            self._final(b, p)

    def final_late(self):
        """The late gradients are complete (their sums over other ranks are done): start their buckets."""
        for p in self.late:
            self._final(self.where[id(p)], p)

    def _final(self, b, p):
        b.final.add(id(p))
        if len(b.final) == len(b.params) and not b.started:
            self.start(b)

    def start(self, b):
        """The bucket's collective, without waiting for it."""
        b.started = True
        if self.size == 1:
            return
        if self.sharded:
            b.work = REDUCE_SCATTER(self.shard_grads[self.buckets.index(b)], b.grad, group=self.group, async_op=True)
        else:
            b.work = dist.all_reduce(b.grad, group=self.group, async_op=True)
        self.count(b.grad, 1 if self.sharded else 2)
        self.on_timeline(b.work, f"{'reduce-scatter' if self.sharded else 'all-reduce'} {self.buckets.index(b)}")

    def count(self, flat, halves):
        """sent_bytes += what a ring sends of this collective of `flat` (halves: 2 for an all-reduce,
        1 for its halves, a reduce-scatter or an all-gather)."""
        self.sent_bytes += halves * (self.size - 1) * flat.numel() * flat.element_size() // self.size

    def on_timeline(self, work, name):
        """The timeline (when it records): the collective's span, from now to its end, on a row of its own.
        gloo's reduce-scatter and all-gather have no completion callback (Work.get_future raises): their
        span ends where the step waited for them (wait()), at most that long."""
        events = getattr(self.recorder, "events", None)
        if events is None:
            return
        start = time.perf_counter()
        try:
            future = work.get_future()
        except RuntimeError:
            self.unclocked.append((work, name, start))
            return
        future.add_done_callback(lambda _: events.append(("collective", name, None, 0, start, time.perf_counter())))

    def clocked(self, work):
        """work was waited for: its span on the timeline, if it had no callback to end it."""
        events = getattr(self.recorder, "events", None)
        for item in [u for u in self.unclocked if u[0] is work]:
            self.unclocked.remove(item)
            if events is not None:
                events.append(("collective", item[1], None, 0, item[2], time.perf_counter()))

    def wait(self):
        """After the step's last backward, before the update: wait for every bucket, divide by the
        group's size. Afterwards each .grad (unsharded), or each replica's shard_grads (sharded), is the
        mean over the replicas. A bucket that never started, or a gradient that arrived after its
        bucket started, stops the run with one error line naming the parameter."""
        for b in self.buckets:
            if not b.started:
                missing = next(p for p in b.params if id(p) not in b.final)
                raise BucketError(f"the gradient of {self.name(missing)} was never said final in this step, so its "
                                  f"bucket's {self.collective()} never started (the code that runs the backward "
                                  f"calls GradBuckets.final once it is done with a parameter)")
        with awaiting(*self.waiting):
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                    self.clocked(b.work)
        if self.too_late is not None:
            raise BucketError(f"a gradient of {self.name(self.too_late)} arrived after its bucket's "
                              f"{self.collective()} had started: the replicas would average part of it; say a "
                              f"parameter final (GradBuckets.final) only after its last backward of the step")
        for b, flat in zip(self.buckets, self.shard_grads if self.sharded else [b.grad for b in self.buckets]):
            if self.size > 1:
                flat /= self.size
        if self.free:   # --zero 2: my slices are all the update needs; the whole gradients go now
            for b in self.buckets:
                b.grad, b.views = None, None
                for p in b.params:
                    p.grad = None

    def name(self, p):
        return self.names.get(id(p), f"a parameter of shape {list(p.shape)}")

    def collective(self):
        return "reduce-scatter" if self.sharded else "all-reduce"
