"""ZeRO-3 (--zero 3; FSDP's idea, written out): a data-parallel replica holds between steps only its 1/D
slice of its stage's weights, and each block's whole weights exist only while the block runs.

--zero 1 (mp.zero) split the optimizer state, --zero 2 the gradients too; both still keep every weight
on every replica. Here the weights go the same way. Each block of the stage is one flat bucket of
mp.buckets.GradBuckets(groups=...): its parameters' data are views into the flat tensor `param`, and
the replica's own slice of it, `mine`, lives in a tensor of its own (the optimizer steps it). Between
uses the flat tensor's storage is given back (resized to 0 bytes: the parameters keep their shapes,
names and autograd identity, but hold nothing); an all-gather of every replica's `mine` fills it again:

    forward of block k:   all-gather block k (prefetched)  |  compute k   |  free k (--zero3-gather microbatch)
                          ...while block k+1's all-gather is already on its way (prefetch)
    backward of block k:  all-gather block k again (microbatch)  |  compute  |  free k, prefetch block k-1
    gradients of block k: reduce-scattered in every microbatch's backward as soon as it has them (mp.buckets),
                          added into my slice's accumulator, the whole bucket let go
    update:               each replica steps its `mine` only; no all-gather after it (the next forward's does it)

With a pipeline, each block runs once per microbatch, forward and backward. --zero3-gather says how
often its weights are gathered:
    step        (the default with several microbatches) once, before its first forward of the step; kept
                through every microbatch's forward and backward, freed once its last backward's gradients
                are in (filled): (D-1)/D of the weights sent per step, but the whole stage's weights held
                at the end of the forward
    microbatch  (the default with one, as FSDP2's reshard_after_forward) before every forward and every
                backward, freed right after each: 2M times the bytes, and only the blocks that are running
                (and the next one, prefetched; in the backward, once the running one is freed) are whole at
                any moment

The hooks are torch's module hooks, so the executor (pipeline_microbatch.StageRunner) is unchanged: a
forward pre-hook gathers the block (and starts the next block's all-gather), a forward hook frees it
(microbatch) and puts a hook on the block's output, which fires when the output's gradient arrives,
that is, just before the block's backward: it gathers the block again. The block's backward is over
once every weight of it has its gradient: mp.buckets says so (when_filled) before it makes the block's
bucket from them, and the whole weights go first; then the previous block's all-gather starts (so one
block is whole at a time in the backward, which starts with every activation held). Should a
weight get no gradient, the block before it receiving its output's gradient frees it, or, for the
first block of a chunk, the backward call returning (a callback queued on autograd's engine, as FSDP
does). Every replica of a stage runs the same schedule, so the all-gathers start in the same order on
every replica, as gloo and nccl need.

While a block is whole, `mine` holds no memory of its own: its bytes are my part of the whole weights, so
its storage is let go once the all-gather is done and made again from there when the block is freed (the
optimizer steps it only after every block is freed; FSDP2 keeps both, the shard and the whole).

Outside the steps: the evaluation's forward gathers a block at a time as a step's does (by_block: each
block gathered by its forward pre-hook, the next one prefetched, freed by its forward hook), so every replica
runs it; a checkpoint writes and a resume reads each replica's `mine` only (mp.checkpoint), nothing
gathered; only the replicas' end-of-run comparison, which reads the parameters themselves, gathers every
block at once (whole). Each phase's peak is counted apart (counting): the summary's peak_param_mb is a
step's, eval_peak_param_mb and resume_peak_param_mb the others' (mp.loop).
"""
from contextlib import contextmanager

import torch

from mp.dist import awaiting
from mp.dp_collectives import all_gather


class ParamShards:
    """The blocks of `chunks` (this rank's part of the model), each one bucket of grads (GradBuckets made
    with groups=weights_by_block(chunks) and shard=True), held as 1/D slices between uses."""

    def __init__(self, chunks, grads, gather_every="step"):
        self.grads, self.gather_every, self.rank = grads, gather_every, grads.rank
        self.pinned, self.evaluating, self.held_bytes, self.phase, self.peaks = False, False, 0, "step", {}
        self.buckets = []                             # one per block, in forward order, chunk by chunk
        for chunk in chunks:
            mine = [self.take(block) for block in blocks_of([chunk])]
            for earlier, later in zip(mine, mine[1:]):   # prefetch within a chunk: the block that runs next
                earlier.next, later.prev = later, earlier
            self.buckets += mine
        for b in self.buckets:
            self.free(b)
        self.own = set(self.buckets)
        grads.when_filled.append(self.filled)
        # held_bytes: the whole weights gathered now; the peak counts from here (the build held them all)
        self.peaks = {"step": self.held_bytes}     # phase -> the most bytes of whole weights held in it
        self.slice_bytes = sum(b.mine.numel() * b.mine.element_size() for b in self.buckets)

    def take(self, block):
        """Block's bucket, with my slice copied out and the hooks on the block."""
        trainable = [p for p in block.parameters() if p.requires_grad]
        b = self.grads.where[id(trainable[0])]
        assert len(b.params) == len(trainable), "GradBuckets(groups=weights_by_block(chunks)): one bucket a block"
        b.block, b.gathering, b.whole, b.next, b.prev = block, None, True, None, None
        b.mine = b.shard(b.param, self.rank).clone()   # my slice, in memory of its own: the optimizer's
        self.held_bytes += b.param.numel() * b.param.element_size()
        block.register_forward_pre_hook(lambda module, inputs: self.before_forward(b))
        block.register_forward_hook(lambda module, inputs, output: self.after_forward(b, output))
        return b

    # --------------------------------------------------------------- gather, wait, free

    def gather(self, b):
        """Start the all-gather of block b's weights into its flat tensor (nothing if it is whole or on its way)."""
        if b.whole or b.gathering is not None:
            return
        storage = b.param.untyped_storage()
        storage.resize_(b.param.numel() * b.param.element_size())   # memory again, filled by the all-gather
        self.note(b.param.numel() * b.param.element_size())
        b.gathering = all_gather(b.param, b.mine, self.rank, self.grads.group)
        self.grads.count(b.param, 1)
        self.grads.spans.begin(b.gathering, f"all-gather {self.buckets.index(b)}", b.param.device)

    def wait(self, b):
        """Block b's weights, whole: gathered now, or the prefetch waited for. Then my slice's own memory goes
        while they are whole: the same bytes sit in my part of them (free makes it again from there)."""
        self.gather(b)
        if b.gathering is not None:
            with awaiting(*self.grads.waiting):
                b.gathering.wait()
            self.grads.spans.end(b.gathering)   # its span on the timeline (gloo's: ends where it was waited for)
            b.gathering, b.whole = None, True
            b.mine.untyped_storage().resize_(0)   # (the optimizer's Parameter shares it: nothing steps it now)
            self.note(-b.mine.numel() * b.mine.element_size())

    def free(self, b):
        """Give block b's whole weights back (an all-gather on its way is waited for first: it writes there),
        my slice first copied out of them into its own memory again."""
        if b.gathering is not None:
            self.wait(b)
        if b.whole:
            storage, nbytes = b.mine.untyped_storage(), b.mine.numel() * b.mine.element_size()
            if not storage.nbytes():          # let go while whole (wait): made again from my part of them
                storage.resize_(nbytes)
                b.mine.copy_(b.shard(b.param.detach(), self.rank))
                self.note(nbytes)
            b.param.untyped_storage().resize_(0)
            b.whole = False
            self.note(-b.param.numel() * b.param.element_size())

    def note(self, nbytes):
        self.held_bytes += nbytes
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.held_bytes)

    # --------------------------------------------------------------- the hooks

    def before_forward(self, b):
        if self.pinned:
            return
        self.wait(b)
        if b.next is not None:
            self.gather(b.next)                       # prefetch: its all-gather runs while b computes

    def after_forward(self, b, output):
        if self.pinned:
            return
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, b=b: self.before_backward(b))
        if self.gather_every == "microbatch" or self.evaluating:   # (step: kept, --recompute's forward
            self.free(b)                                            # without autograd too)

    def before_backward(self, b):
        """The gradient of b's output arrived: b's backward is next, and b.next's is over (its input's
        gradient is b's output's)."""
        if self.gather_every == "microbatch":
            if b.next is not None:
                self.free(b.next)                     # first: at most two blocks whole (b, and the prefetch)
            # the first block of a chunk has no block before it to say so: free it when this backward returns
            torch.autograd.Variable._execution_engine.queue_callback(lambda b=b: self.free(b))
        # b's gradients come next, made by autograd beside b's whole weights: the reduce-scatters on their
        # way that would not fit beside them are waited for now (mp.buckets: make_room), not after
        self.grads.make_room(b)
        self.wait(b)

    def filled(self, b):
        """Every weight of block b has its gradient of this backward (mp.buckets calls it before making the
        bucket from them): no node of autograd reads b's weights again in it (a weight's gradient is
        accumulated once all its uses are done), so they go now, as FSDP2 reshards in its post-backward,
        and before the bucket is made, rather than when the block before b starts its backward or the
        backward returns (the fallbacks, for a block some of whose weights get no gradient). --zero3-gather
        step keeps them until the step's last backward of b (its gradients said expected: GradBuckets.expect)."""
        if self.pinned or b not in self.own:
            return
        if self.gather_every == "microbatch" or len(b.expected) == len(b.params):
            self.free(b)
        if self.gather_every == "microbatch" and b.prev is not None:
            # prefetch for the backward that comes next, now that b's weights are gone: started with b's
            # backward (FSDP2's), it held two blocks whole beside the activations at their peak, the
            # backward's start (the vit's: 2 MB a rank more than FSDP2's, whose units are single Linears)
            self.gather(b.prev)

    # --------------------------------------------------------------- the step, and whole weights

    def release(self):
        """The step's backward is over: every block's whole weights go (--zero3-gather step kept them
        through every microbatch; microbatch has freed them already)."""
        for b in self.buckets:
            self.free(b)

    @contextmanager
    def counting(self, phase):
        """What is gathered inside counts as `phase`'s peak (the resume, the evaluation), not a step's; nor
        are its bytes sent a step's (the summary's dp_sent_mb_per_step)."""
        outer, sent = self.phase, self.grads.sent_bytes
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), self.held_bytes)
        try:
            yield
        finally:
            self.phase, self.grads.sent_bytes = outer, sent

    @contextmanager
    def by_block(self):
        """A forward outside a step (the evaluation, under no_grad): each block gathered as its forward starts
        (the next one's all-gather started too) and freed as it ends, as a step's forward under
        --zero3-gather microbatch, whatever --zero3-gather: at most two blocks whole. Every replica must run
        the same forwards (the all-gathers are collectives)."""
        with self.counting("evaluation" if self.phase == "step" else self.phase):
            self.evaluating = True
            try:
                yield
            finally:
                self.evaluating = False
                for b in self.buckets:     # (each forward freed its block; a prefetch no forward used goes too)
                    self.free(b)

    @contextmanager
    def whole(self):
        """Every block gathered for what runs inside (the end-of-run comparison, which reads the parameters:
        every replica must enter, the all-gathers are collectives), then each replica's slice copied back
        from the whole weights and the whole weights freed."""
        with self.counting("whole" if self.phase == "step" else self.phase):
            for b in self.buckets:
                self.gather(b)
            for b in self.buckets:
                self.wait(b)
            self.pinned = True
            try:
                yield
            finally:
                self.pinned = False
                with torch.no_grad():
                    for b in self.buckets:
                        if b.mine.untyped_storage().nbytes():   # (else free makes it again from the whole weights)
                            b.mine.copy_(b.shard(b.param, self.rank))
                        self.free(b)

    def peak_mb(self, phase="step"):
        """The most weights this rank held at once in a phase (a step; "resume", "evaluation": counting):
        its slices and the blocks gathered. None for a phase that has not run."""
        return None if phase not in self.peaks else (self.slice_bytes + self.peaks[phase]) / 2**20


def blocks_of(chunks):
    """The blocks (a chunk's children) that hold trainable weights, in forward order."""
    return [block for chunk in chunks for block in chunk if any(p.requires_grad for p in block.parameters())]


def weights_by_block(chunks):
    """GradBuckets' groups for --zero 3: the parameters of each block, a bucket each."""
    return [list(block.parameters()) for block in blocks_of(chunks)]
