"""Data-parallel gradients in flat buckets, each one's collective started as soon as its own gradients
are final, so that it overlaps the backward of the layers before it (DDP's idea, written out); under
--zero 2 and 3, in every microbatch's backward (ZeRO-2's and FSDP's).

Each parameter's .grad is a view into one flat bucket (a bucket holds consecutive parameters in the
order backward finishes them: the last layers first), so a bucket goes to the collective as it is:
no copy in, no copy out. When a gradient is final is said, never inferred: the code that runs the
backward says expect(params) just before the last backward that touches them in the step (the
pipeline's executor: before a chunk's last B, or its last W under zero-bubble), so the gradient each
of them receives from then on is its last; a bucket whose parameters all have theirs starts its
collective (async_op=True) while that backward goes on into the earlier layers. Once the backward is
over the executor says final(params), which starts what still waits (a parameter that got no
gradient); wait() waits for every bucket just before the optimizer step.

    the last microbatch's backward:   [ layer 8 | layer 7 | layer 6 | ... | layer 1 ]
    bucket 0 (layers 8-6):                       all-reduce ------>
    bucket 1 (layers 5-1):                                           all-reduce --->   wait, step

A mistake here would be silent (a bucket summed before its last gradient arrived averages part of
the gradient), so it is made loud instead: a hook on each parameter notes a gradient that arrives
after its bucket started, and wait() stops with one error line naming the parameter, as it does for
a bucket that never started (a parameter never said final). The weights that zero-bubble's W writes
itself (in place, no autograd, so no hook would run) are `direct`: W reports them through
arriving() and arrived().

Every replica runs the same schedule on the same stage, so the buckets start in the same order on
every rank of the group (gloo and nccl need that). shard=True (--zero 1, mp.zero): each bucket is
padded to a multiple of the group's size and reduce-scattered in place, into this replica's 1/D of
the bucket itself (Megatron's distributed optimizer does the same): each replica receives the sum of
its slice, and no buffer of its own holds it.

free=True (--zero 2 and 3) partitions the gradients through the step: a bucket is reduce-scattered
in every microbatch's backward, as soon as each of its parameters has that microbatch's gradient,
its slice added into this replica's accumulator (`acc`, 1/D of the bucket, the optimizer's gradient)
and the whole bucket let go. The bucket is made from autograd's own gradient tensors once they are all
in (`copy_in`, fill); one holding a weight that zero-bubble's W writes itself is made when its first
gradient arrives instead (W says arriving()), and W adds into it:

    microbatch k's backward:  [ layer 8 | layer 7 | ... | layer 1 ]
    bucket 0:                 filled, made | reduce-scatter --> acc += my slice, freed
    bucket 1:                                     filled, made | reduce-scatter --> acc += my slice, freed

So a replica holds its accumulators (1/D of the gradients) and the buckets in flight: the ones being
filled and at most IN_FLIGHT being reduce-scattered (waiting for the oldest is what frees it). No
collective copies its bucket (mp.dp_collectives: on gloo the bucket is all-reduced in place), a
bucket of one parameter is autograd's own gradient tensor, uncopied (Bucket.alone), and on gloo a
copy_in bucket with a gradient larger than the set size has each gradient all-reduced where autograd
made it (Bucket.apart), uncopied. The price: M
reduce-scatters a step, (M + 1)(D-1)/D N sent with the all-gather where --zero 1 sends 2(D-1)/D N
(docs/optimizers.md). `late` gradients (parallel_3d.py's tensor-parallel sums, complete only after the
backward) are reduced once, after those sums. groups (--zero 3, mp.param_shards): one bucket per block,
its weights gathered and freed as one flat tensor. --zero 0 and 1 let a bucket's memory go at zero_grad
and make it again before its first gradient (`lazy`), as torch's set_to_none lets .grad go.

sent_bytes counts what this replica sends in the data-parallel collectives as a ring moves them (2(D-1)/D
of a buffer for an all-reduce, (D-1)/D for its halves: dp_sent_mb_per_step); held_bytes and peak_bytes
the gradients' memory where it is made and let go (the buckets, the accumulators: peak_grad_mb).
"""
import torch
import torch.distributed as dist

from mp.dist import awaiting, buckets
from mp import dp_collectives
from mp.dp_collectives import CollectiveSpans, Works, reduce_scatter
from mp.errors import CommError
from mp.heap import keep_in_heap

BUCKET_MB = 4   # --zero 2, 3 (made and let go in every microbatch: few alive at once); the least a kept one holds
KEPT_MAX_MB = 25   # the most a kept bucket (--zero 0, 1) holds: DDP's cap
IN_FLIGHT = 2   # reduce-scatters on their way at once; a third waits for the oldest (the memory bound)


def kept_bytes(params, least_mb=BUCKET_MB, most_mb=KEPT_MAX_MB):
    """The size at which --zero 0 and 1 close a bucket over these parameters (a stage's): half their bytes,
    so that the later half's collective overlaps the earlier half's backward, within [least_mb, most_mb]. Each
    collective costs the backend's threads a start and a wait of its own; with no idle core to overlap on
    (4 ranks on 2), the vit's 12 MB in four buckets of at most 4 MB took 1.02-1.03 of DDP's step, in two
    0.99 (benchmarks/data_axis.py in lockstep, 2026-11-29). A stage of 8 MB or less keeps 4 MB buckets, so a
    pipeline's stages still overlap (tests/test_hot_path.py)."""
    total = sum(p.numel() * p.element_size() for p in params)
    return min(max(least_mb * 2**20, total / 2), most_mb * 2**20)


def kept_groups(params, nbytes):
    """The buckets kept through the step (--zero 0, 1): the parameters (in backward order) cut into
    consecutive groups of at most nbytes (a larger layer alone), a layer's bias riding with its weight: the
    small parameters just before one that opens a group (under 1/64 of it: its bias, a head's) open it with
    it. Cut plainly at most nbytes (mp.dist.buckets, --zero 2's), a 4 MB weight beside a 4 KB bias made every
    bias a bucket of its own, a collective with its own start and wait for 4 KB (the mlp's 1024-wide layers:
    14 buckets, not 7; 56 broadcasts a step under --zero 1, not 28). A last group under a quarter of nbytes
    joins the one before (the vit's embeddings, 0.11 MB, were a collective of their own)."""
    size = lambda p: p.numel() * p.element_size()   # noqa: E731
    groups, held = [], 0
    for p in params:
        if not groups or held + size(p) > nbytes:
            carried = []
            while groups and groups[-1] and size(groups[-1][-1]) * 64 < size(p):
                carried.insert(0, groups[-1].pop())
            if groups and not groups[-1]:     # all of it carried on
                groups.pop()
            groups.append(carried)
            held = sum(map(size, carried))
        groups[-1].append(p)
        held += size(p)
    if len(groups) > 1 and held < nbytes / 4:
        tail = groups.pop()
        groups[-1] += tail
    return groups


class Bucket:
    """Consecutive parameters' gradients in one flat tensor (padded to a multiple of `parts` when sharded).
    every_microbatch (--zero 2, 3): reduced in every microbatch's backward into acc, my slice's sum."""

    def __init__(self, params, parts, device, every_microbatch=False, direct=False):
        self.params, self.offsets = params, []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel, self.parts = n, parts
        self.padded, self.dtype, self.device = -(-n // parts) * parts, params[0].dtype, device
        self.nbytes, self.every_microbatch = self.padded * params[0].element_size(), every_microbatch
        self.grad = self.views = self.work = self.acc = None
        # alone: one parameter, no padding, made for every microbatch: autograd's gradient is the bucket
        # (an empty .grad takes the new gradient tensor as it is); not a weight our own code writes (direct)
        self.alone = every_microbatch and len(params) == 1 and self.padded == n and not direct
        # copy_in (--zero 2, 3): made only once every gradient of the microbatch is in, from autograd's own
        # tensors, so that the weights can go first (GradBuckets.when_filled: --zero 3's whole block, --zero 2's
        # all but my slice); on gloo, with a gradient larger than the set size, not made at all (apart). Made
        # at the first gradient and added into instead, --zero 2's vit peaked higher: 381 MB against 367
        # (benchmarks/data_axis.py, 4 ranks; the mlp's the same, 261 against 262)
        self.copy_in = self.alone or (every_microbatch and not direct)
        self.started, self.expected, self.final, self.filled = False, set(), set(), set()
        self.lazy = False                 # GradBuckets: --zero 0, 1 let its memory go through the forward
        self.apart = None                 # copy_in on gloo: autograd's own tensors, all-reduced where they are

    def holds(self):
        """Does the bucket hold this microbatch's gradients (flat, or apart)?"""
        return self.grad is not None or self.apart is not None

    def make_grad(self):
        """The flat gradient, zeroed, and each parameter's .grad a view into it."""
        self.grad = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.views = [self.grad[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]
        self.point_grads()

    def point_grads(self):
        """Each .grad a view into the bucket again (an optimizer's zero_grad(set_to_none=True) drops them)."""
        for p, view in zip(self.params, self.views):
            p.grad = view

    def assemble(self):
        """copy_in: the flat bucket from the parameters' own gradients, each .grad then a view into it (alone:
        the one gradient is the bucket, a view of it). Returns the bytes made."""
        if self.alone:
            p = self.params[0]
            self.grad, self.views = p.grad.detach().reshape(-1), [p.grad]
            return 0
        grads = [p.grad for p in self.params]
        self.grad = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        self.grad[self.numel:].zero_()
        self.views = [self.grad[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]
        for view, g in zip(self.views, grads):
            view.copy_(g) if g is not None else view.zero_()   # (no gradient in this microbatch: zeros)
        self.point_grads()                # autograd's tensors go
        return self.nbytes

    def drop_grad(self):
        self.grad = self.views = None
        for p in self.params:
            p.grad = None

    def hold_params(self):
        """--zero 1: the parameters' data become views into one flat tensor too, so that an all-gather
        writes every replica's updated slice into them directly (the values are kept)."""
        self.param = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
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

    def __init__(self, params, group, waiting, shard=False, bucket_mb=None, recorder=None, late=(), direct=(),
                 free=False, groups=None):
        params = [p for p in params if p.requires_grad][::-1]   # backward finishes the last layers first
        self.late_ids = {id(p) for p in late}
        self.late = [p for p in params if id(p) in self.late_ids]
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.waiting, self.sharded, self.spans = waiting, shard, CollectiveSpans(recorder)
        self.free = free and shard          # --zero 2, 3: reduced in every microbatch, the whole buckets let go
        device = params[0].device if params else torch.device("cpu")
        if groups is None:            # bucket_mb given (--bucket-mb, the tests): the cap as it is
            # the late ones last, in buckets of their own: mixed in, each would hold its bucket back until after
            # the backward (under --sequence-parallel a norm in every block: no bucket would overlap it)
            params = [p for p in params if id(p) not in self.late_ids] + self.late
            kept = kept_bytes(params) if bucket_mb is None else bucket_mb * 2**20
            groups = buckets(params, (bucket_mb or BUCKET_MB) * 2**20) if self.free else kept_groups(params, kept)
        else:                                         # given (--zero 3: a block each), the last block's first
            groups = [g for g in ([p for p in ps if p.requires_grad][::-1] for ps in groups[::-1]) if g]
        direct = {id(p) for p in direct}
        bucket_mb = BUCKET_MB if bucket_mb is None else bucket_mb
        self.buckets = [Bucket(ps, self.size if shard else 1, device,
                               self.free and not any(id(p) in self.late_ids for p in ps),
                               any(id(p) in direct for p in ps)) for ps in groups]
        for b in self.buckets:                        # made when first needed in a step (let_go, make)
            b.lazy = not b.every_microbatch and not any(id(p) in self.late_ids for p in b.params)
        self.when_filled = []                         # f(bucket) once a bucket's gradients are all in (say_filled)
        self.sent_bytes, self.held_bytes, self.peak_bytes, self.in_flight = 0, 0, 0, []
        # bytes of buckets on their way and filling (make_room): IN_FLIGHT + 1 of the set size, or of the
        # median bucket's where that is larger (--zero 3's blocks: a 4 MB weight and its bias)
        sizes = sorted(b.nbytes for b in self.buckets) or [0]
        self.room = (IN_FLIGHT + 1) * max(bucket_mb * 2**20, sizes[len(sizes) // 2])
        self.set_bytes = bucket_mb * 2**20
        self.where = {id(p): b for b in self.buckets for p in b.params}
        self.names = {}                               # id -> a name for error lines (name_params)
        self.too_late = None                          # the first gradient that arrived after its bucket started
        self.step = None                              # the step under way, for the error lines (zero_grad)
        self.uncollected = None                       # the first .grad written that no bucket collected
        for b in self.buckets:
            if self.free:                             # my slice's gradient, kept through the step
                b.acc = torch.zeros(b.padded // self.size, dtype=b.dtype, device=device)
                self.note(b.acc.numel() * b.acc.element_size())
            else:                                     # the whole bucket, kept through the run
                b.make_grad()
                self.note(b.nbytes)
            if shard:
                b.hold_params()
        # the bytes let go and made again every step (lazy buckets, accumulators, buckets on their way): kept
        # by glibc between steps, not given back to the kernel and faulted in again (mp.heap)
        churn = sum(b.nbytes for b in self.buckets if b.lazy) + (self.room if self.free else 0)
        churn += sum(b.acc.numel() * b.acc.element_size() for b in self.buckets if b.acc is not None)
        keep_in_heap(churn, device)
        for p in params:
            if id(p) not in direct:
                p.register_post_accumulate_grad_hook(self.arrived)
                if self.free or self.where[id(p)].lazy:   # before autograd accumulates: the bucket's memory
                    p.register_hook(lambda grad, p=p: self.arriving(p))

    def name_params(self, named):
        """Name the parameters (named: [(name, p)]) for the error lines."""
        self.names.update({id(p): name for name, p in named})

    def my_grad(self, b):
        """The mean gradient of my slice of bucket b after wait(): the accumulator (--zero 2, 3), or my
        1/D of the bucket itself, where the reduce-scatter wrote it (--zero 1)."""
        return b.acc if b.acc is not None else b.shard(b.grad, self.rank)

    @property
    def shard_grads(self):
        return [self.my_grad(b) for b in self.buckets]

    def note(self, nbytes):
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def peak_mb(self):
        """The most bytes of gradients this rank held at once (buckets and accumulators), in MB."""
        return self.peak_bytes / 2**20

    def zero_grad(self, step=None):
        """Before step `step`'s first backward: zeroed buckets (--zero 2, 3: the accumulators let go, made zeroed
        by the first reduce-scatter; the buckets are made as their gradients arrive), each .grad a view into
        its bucket."""
        self.step = step
        for b in self.buckets:
            if b.every_microbatch:        # as torch's zero_grad(set_to_none=True): made again when first needed
                self.let_go(b.acc)
            elif b.grad is None:          # --zero 2: a late bucket let go after the last step
                b.make_grad()
                self.note(b.nbytes)
            elif b.lazy:                  # its memory let go until needed, and no .grad pointing into it meanwhile
                self.let_go(b.grad)
                for p in b.params:
                    p.grad = None
            else:
                b.grad.zero_()
                b.point_grads()
            b.work, b.started, b.expected, b.final, b.filled = None, False, set(), set(), set()
        self.too_late, self.uncollected, self.in_flight = None, None, []

    def expect(self, params):
        """The caller is about to run the last backward of the step that touches these parameters: the
        gradient each receives from now on is final, and a bucket starts once all of its own are."""
        for p in params:
            b = self.where.get(id(p))
            if b is not None and id(p) not in self.late_ids:
                b.expected.add(id(p))

    def arriving(self, p):
        """A gradient is about to be added to p's (autograd's hook; zero-bubble's W before it writes):
        --zero 2, 3: its bucket's memory, made now (an earlier microbatch's reduce-scatter of it finished first)."""
        b = self.where.get(id(p))
        if b is None or not b.every_microbatch:
            if b is not None and b.lazy:
                self.make_lazy(b)
            return
        if b.started:
            self.retire(b)
        if b.copy_in:                     # autograd hands its new gradient to the empty .grad, uncopied
            return
        if b.grad is None:
            self.make_room(b)
            b.make_grad()
            self.note(b.nbytes)

    def make_room(self, b):
        """Before bucket b's memory is made: the oldest reduce-scatters on their way are waited for (and their
        buckets let go) while they and b together would exceed what IN_FLIGHT + 1 buckets of the set size
        hold, so a bucket larger than the rest (a layer of its own above BUCKET_MB) is never made beside
        others still on their way: the peak is the largest bucket, not the largest plus two. gloo runs its
        collectives in order anyway, so the big one could not have finished sooner."""
        while self.in_flight and sum(q.nbytes for q in self.in_flight) + b.nbytes > self.room:
            self.retire(self.in_flight[0])

    def arrived(self, p):
        """A gradient was added to p's (the hooks; zero-bubble's W calls it for the weights it writes)."""
        b = self.where.get(id(p))
        if b is None:
            return
        if id(p) in b.final or (b.started and not b.every_microbatch):
            if self.too_late is None:
                self.too_late = p
        elif b.every_microbatch:          # this microbatch's gradient: the bucket starts when all are in
            if b.copy_in and id(p) not in b.filled:
                self.note(p.grad.numel() * p.grad.element_size())
            b.filled.add(id(p))
            if len(b.filled) == len(b.params):
                if b.copy_in:
                    self.fill(b)
                else:
                    self.say_filled(b)
                self.start(b)
        elif id(p) in b.expected:         # the step's last gradient of p
            self._final(b, p)

    def say_filled(self, b):
        """Bucket b's gradients of this backward are all in, so no autograd node reads its weights again in it:
        --zero 3 lets the block's whole weights go, --zero 2 all but my slice (ZeroOptimizer.release)."""
        for f in self.when_filled:
            f(b)

    def fill(self, b):
        """A copy_in bucket's gradients are all in, as autograd's own tensors: say so (say_filled), make room,
        then the flat bucket from them (nccl's reduce-scatter reads one flat tensor), or none (apart: gloo,
        a gradient larger than the set size)."""
        self.say_filled(b)
        self.make_room(b)
        largest = max((p.grad.numel() * p.grad.element_size() for p in b.params if p.grad is not None), default=0)
        if dp_collectives.reduce_scatter_copies(self.group) and not b.alone and largest > self.set_bytes:
            # gloo, where our reduce-scatter is an all-reduce in place, and a gradient larger than a bucket: each
            # all-reduced where autograd made it, not copied into a flat bucket first (the mlp's 12 MB layer: 12 MB
            # less at the peak). Not a block of small ones: a collective each cost the vit's steps 30%
            b.apart = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            return
        apart = sum(p.grad.numel() * p.grad.element_size() for p in b.params if p.grad is not None)
        if b.assemble():                  # both at once while it copies, then autograd's tensors go
            self.note(b.nbytes)
            self.note(-apart)

    def final(self, params):
        """The caller ran the last backward that touches these parameters in this step: start each bucket
        whose parameters are all final and which still holds gradients (the late ones wait for final_late())."""
        for p in params:
            b = self.where.get(id(p))
            if b is None or id(p) in self.late_ids:
                continue
            self._final(b, p)

    def final_expected(self):
        """The backwards said in expect() have run, their Ws too: every gradient expected is final (a
        bucket whose own all arrived has started already; this starts the rest)."""
        for b in self.buckets:
            for p in b.params:
                if id(p) in b.expected:
                    self._final(b, p)

    def final_late(self):
        """The late gradients are complete (their sums over other ranks are done): start their buckets."""
        for p in self.late:
            self._final(self.where[id(p)], p)

    def _final(self, b, p):
        b.final.add(id(p))
        if len(b.final) == len(b.params) and not b.started and b.copy_in and not b.holds() and b.filled:
            self.fill(b)                  # a copy_in bucket some of whose parameters had no gradient
        if len(b.final) == len(b.params) and not b.started and b.holds():
            self.start(b)

    def start(self, b):
        """The bucket's collective, without waiting for it (at most IN_FLIGHT on their way where that lowers
        the peak: bounded_by_in_flight)."""
        b.started = True
        if b.lazy:
            self.make_lazy(b)
        if self.size > 1:
            if b.apart is not None:       # each gradient in place (on the wire, as gloo's reduce-scatter)
                b.work = Works([dist.all_reduce(g, group=self.group, async_op=True) for g in b.apart])
            elif self.sharded:            # in place: my slice of the bucket receives the sum of my slice
                b.work = reduce_scatter(b.grad, self.rank, self.group)
            else:
                b.work = dist.all_reduce(b.grad, group=self.group, async_op=True)
            self.count(b.param if b.apart is not None else b.grad, 1 if self.sharded else 2)
            self.spans.begin(b.work, f"{self.collective()} {self.buckets.index(b)}", b.params[0].device)
        if self.bounded_by_in_flight(b):
            self.in_flight.append(b)
            while len(self.in_flight) > IN_FLIGHT:
                self.retire(self.in_flight[0])
            self.room_ahead(b)

    def room_ahead(self, b):
        """A bucket larger than the set size among the next two in backward order (a large layer's weight
        and its bias, whose gradients one node of autograd makes at once, before any hook of ours runs):
        the reduce-scatters that would not fit beside it are waited for now, before that layer's backward
        (--zero 3's blocks say so themselves: ParamShards.before_backward). Only the order is guessed: a
        wrong guess waits sooner than needed, never changes a number."""
        i = self.buckets.index(b)
        for nxt in self.buckets[i + 1:i + 3]:
            if nxt.every_microbatch and nxt.grad is None and nxt.nbytes > self.room // (IN_FLIGHT + 1):
                self.make_room(nxt)

    def bounded_by_in_flight(self, b):
        """Does bucket b count against IN_FLIGHT? Where waiting sooner lowers the peak (--zero 2, 3: retire lets
        it go); elsewhere it stays whole through the step anyway, its collective on its way until wait()."""
        return b.every_microbatch

    def retire(self, b):
        """Bucket b's reduce-scatter waited for; --zero 2, 3: my slice added into my accumulator and the
        bucket let go, to be made again for the next microbatch."""
        if b.work is not None:
            with awaiting(*self.waiting):
                b.work.wait()
            self.spans.end(b.work)
        b.work = None
        self.in_flight.remove(b)
        if b.every_microbatch:
            self.make(b.acc)
            if b.apart is not None:       # my slice's pieces, parameter by parameter
                summed = dict(zip(map(id, b.params), b.apart))
                for p, start, first, n in b.segments(self.rank):
                    b.acc[start:start + n] += summed[id(p)].reshape(-1)[first:first + n]
                self.note(-sum(g.numel() * g.element_size() for g in b.apart))
                b.apart = None
            else:
                b.acc += b.shard(b.grad, self.rank)
                self.note(-b.nbytes)
            b.drop_grad()
            b.started, b.filled = False, set()

    def let_go(self, t):
        """At a step's start, as torch's zero_grad(set_to_none=True): t's memory goes (the tensor and views of it
        stay) until make(t): a lazy bucket (--zero 0, 1) or an accumulator (--zero 2, 3). So the forward runs
        without them (the vit's peak; --zero 3 step's whole weights)."""
        storage = t.untyped_storage()
        if storage.nbytes():
            self.note(-storage.nbytes())
            storage.resize_(0)

    def make_lazy(self, b):
        """A lazy bucket's memory again, zeroed, and each .grad a view into it: zero_grad let both go, so that a
        gradient written without telling the buckets is a tensor of its own (all_collected names it), never a
        write into memory let go."""
        if not b.grad.untyped_storage().nbytes():
            if self.uncollected is None:
                self.uncollected = next((p for p in b.params if p.grad is not None), None)
            self.make(b.grad)
            b.point_grads()

    def make(self, t):
        """t's memory again, zeroed: a lazy bucket's before its first gradient or collective, an accumulator's."""
        storage, nbytes = t.untyped_storage(), t.numel() * t.element_size()
        if not storage.nbytes():
            storage.resize_(nbytes)
            t.zero_()
            self.note(nbytes)

    def count(self, flat, halves):
        """sent_bytes += what a ring sends of this collective of `flat` (halves: 2 for an all-reduce,
        1 for its halves, a reduce-scatter or an all-gather)."""
        self.sent_bytes += halves * (self.size - 1) * flat.numel() * flat.element_size() // self.size

    def wait(self):
        """After the step's last backward, before the update: wait for every bucket, divide by the
        group's size. Afterwards each .grad (unsharded), or each replica's my_grad (sharded), is the
        mean over the replicas. A bucket that never started, or a gradient that arrived after its
        bucket started, stops the run with one error line naming the parameter."""
        for b in self.buckets:
            if len(b.final) < len(b.params):
                missing = next(p for p in b.params if id(p) not in b.final)
                raise BucketError(f"the gradient of {self.name(missing)} was never said final in this step, so its "
                                  f"bucket's {self.collective()} never started (the code that runs the backward "
                                  f"calls GradBuckets.final once it is done with a parameter)")
        for b in list(self.in_flight):
            self.retire(b)
        for b in self.buckets:
            if b.every_microbatch:
                self.make(b.acc)          # (a bucket none of whose gradients came: zeros)
        with awaiting(*self.waiting):
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                    self.spans.end(b.work)
        if self.too_late is not None:
            raise BucketError(f"a gradient of {self.name(self.too_late)} arrived after its bucket's "
                              f"{self.collective()} had started: the replicas would average part of it; say a "
                              f"parameter final (GradBuckets.final) only after its last backward of the step")
        self.all_collected()
        for b in self.buckets:
            if not b.every_microbatch and self.free:   # a late bucket under --zero 2, 3: my slice kept, the rest goes
                b.acc.copy_(b.shard(b.grad, self.rank))
                b.drop_grad()
                self.note(-b.nbytes)
            if self.size > 1:
                flat = b.grad if not self.sharded else self.my_grad(b)
                flat /= self.size

    def all_collected(self):
        """Loud, not silent: a .grad that no bucket holds at the end of the step is a gradient the replicas
        never summed, and the optimizer would step on the bucket's zeros instead (a weight whose gradient our
        own code wrote, with nobody telling the buckets: zero-bubble's W for a bucket it was not handed). Kept
        through the step (--zero 0, 1), a .grad must be a view into its bucket; let go after each microbatch's
        reduce-scatter (--zero 2, 3), there must be none left."""
        for b in self.buckets:
            kept = None if self.free and b.every_microbatch else b.grad
            for p in b.params:
                if self.uncollected is None and p.grad is not None and (
                        kept is None or p.grad.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()):
                    self.uncollected = p
        if self.uncollected is not None:
            at = "" if self.step is None else f" of step {self.step}"
            raise BucketError(f"{self.name(self.uncollected)} holds a gradient{at} that its bucket never collected, "
                              f"so the replicas would step on zeros for it: the code that wrote it did not tell the "
                              f"buckets (GradBuckets.arriving and arrived, or the hooks)")

    def name(self, p):
        return self.names.get(id(p), f"a parameter of shape {list(p.shape)}")

    def collective(self):
        return "reduce-scatter" if self.sharded else "all-reduce"


class BucketSets:
    """Several GradBuckets over different groups, told as one by the code that runs the backward (the
    pipeline's executor and zero-bubble's W): parallel_5d.py's dense buckets (over dp x cp) and its experts'
    (over edp). Each call goes to every set, and each set heeds only its own parameters, so an expert's
    gradient reaches the experts' buckets wherever it is made (by autograd, or by W in place) and they start
    during the backward as the dense ones do."""

    def __init__(self, *sets):
        self.sets = [s for s in sets if s is not None]

    def expect(self, params):
        for s in self.sets:
            s.expect(params)

    def final_expected(self):
        for s in self.sets:
            s.final_expected()

    def arriving(self, p):
        for s in self.sets:
            s.arriving(p)

    def arrived(self, p):
        for s in self.sets:
            s.arrived(p)
