"""ZeRO-1 (Rajbhandari et al., 2020; Megatron's distributed optimizer): the data-parallel replicas
share out the optimizer state instead of each keeping all of it.

Without it every replica of a stage holds the same parameters, gets the same averaged gradient, and
runs the same optimizer step on the same state: D copies of one computation. AdamW's state is twice
the parameters, so that copy is the largest thing the data axis duplicates. With --zero 1 the
all-reduce of the gradients is split into its two halves (all-reduce = reduce-scatter + all-gather,
the same bytes on the wire), and the optimizer step runs between them on a slice:

    gradients (flat buckets)  --reduce-scatter-->  replica d: the mean gradient of its 1/D slice
    replica d: optimizer step on its slice, with the state of that slice only (1/D of the state)
    updated slices            --all-gather----->   every replica: the whole updated parameters

Each bucket of mp.buckets.GradBuckets(shard=True) is padded to a multiple of D and cut into D equal
slices; the parameters' data and gradients are views into the buckets, so the collectives read and write
them in place: the reduce-scatter into my slice of the bucket itself (--zero 2 and 3: in every
microbatch's backward, my slice then added into an accumulator of its own and the bucket let go). The
optimizer is torch's own (mp.optim.make_optimizer), stepping one flat Parameter per bucket that is a
view of this replica's slice: elementwise updates (SGD's momentum, AdamW's moments and decay) give
exactly the numbers the whole update would. Clipping takes the global norm over the slices (every
replica sums the squares of its slice; mp.clipping sums them over the replicas too). A checkpoint stays
in the baseline model's coordinates: each replica writes its slices only, each piece of a parameter as
the flat range of it that the slice holds (saved_pieces, mp.checkpoint's `#first:count:shape` keys: a
sharded state, nothing gathered), and resuming, in any layout, reads into this replica's slices the parts
of the saved pieces that overlap them, then (--zero 1, 2) all-gathers the weights as after an update
(docs/optimizers.md).

--zero 2 (release): once a bucket's gradients of the step's last backward are all in, nothing reads its
weights until the all-gather after the update rewrites all but my slice; so my slice moves to a tensor of
its own and the bucket's whole weights go, made whole again (rejoin) just before that all-gather.

--zero 3 (mp.param_shards.ParamShards, `shards`): the slices are tensors of their own, not views of the
whole weights, which exist only while a block runs; so the step ends after the update, without the
all-gather (the next forward gathers each block, the evaluation's too: whole_params); a save writes each
replica's slice of the weights too, and a resume reads them straight into each replica's slices, nothing
gathered.
"""
import contextlib

import torch
import torch.nn as nn

from mp import optim
from mp.clipping import grad_squares
from mp.dist import awaiting
from mp.dp_collectives import all_gather


class ZeroOptimizer:
    """torch's optimizer over this replica's slices of the buckets, then the all-gather of the slices
    (--zero 3: none; each block's forward gathers its weights)."""

    def __init__(self, grad_buckets, args, shards=None):
        self.grads, rank, self.shards = grad_buckets, grad_buckets.rank, shards
        # a Parameter made from a view shares its memory: stepping it writes into the flat parameters
        # (--zero 3: into my slice, b.mine, which the next forward's all-gather reads)
        self.slices = [nn.Parameter(b.mine if shards else b.shard(b.param, rank)) for b in grad_buckets.buckets]
        for s, g in zip(self.slices, grad_buckets.shard_grads):
            s.grad = g
        # a param group per slice: torch's foreach update (its default on a GPU) makes its temporaries
        # (AdamW's sqrt of the second moment, its step) for a whole group at once, so one group would add
        # N/D of them at the update, a group a slice only the largest slice's (on the CPU torch updates a
        # tensor at a time anyway); the same kernels on each element, so the same bits
        self.inner = optim.make_optimizer([{"params": [s]} for s in self.slices], args)
        self.state, self.param_groups = self.inner.state, self.inner.param_groups
        self.released = {}                # --zero 2: bucket -> its slice's index, whole weights let go (release)
        if grad_buckets.free and not shards:
            grad_buckets.when_filled.append(self.release)

    def zero_grad(self, set_to_none=True):
        self.grads.zero_grad()

    def release(self, b):
        """--zero 2: bucket b's gradients of the step's last backward are all in (each of its parameters said
        expected, GradBuckets.say_filled). Nothing reads its weights again before the all-gather after the
        update, which rewrites all but my slice: so my slice moves to a tensor of its own (the optimizer's
        Parameter takes it as its data; its state is keyed by the Parameter, not the memory) and the whole
        weights go, as FSDP2 reshards a module after its backward. The peak of the backward then holds the
        whole weights of the buckets still to come and my slices of the others, not every weight; step()
        makes them whole again (rejoin), one bucket before its all-gather."""
        if len(b.expected) < len(b.params) or b in self.released:
            return
        i = self.grads.buckets.index(b)
        self.slices[i].data = self.slices[i].detach().clone()
        b.param.untyped_storage().resize_(0)
        self.released[b] = i

    def rejoin(self, b):
        """--zero 2, after the update: bucket b's whole weights made again, my updated slice in its place."""
        mine = self.slices[self.released.pop(b)]
        b.param.untyped_storage().resize_(b.nbytes)
        place = b.shard(b.param, self.grads.rank)
        place.copy_(mine.detach())
        mine.data = place                 # a view into the parameters again, as --zero 1's

    def step(self):
        """My slices' update, then every replica's slices into every replica's parameters."""
        self.inner.step()
        if not self.shards:               # --zero 3: each block's next forward gathers its weights
            self.share()

    def share(self):
        """Every replica's slices into every replica's whole weights (--zero 1, 2)."""
        group, works = self.grads.group, []
        for b, mine in zip(self.grads.buckets, self.slices):
            if b in self.released:        # --zero 2: whole again, then the others' slices broadcast into place
                self.rejoin(b)
            # in place: my slice already sits at my offset of b.param, which every rank's slices fill
            works.append(all_gather(b.param, mine.detach(), self.grads.rank, group))
            self.grads.count(b.param, 1)
        with awaiting(*self.grads.waiting):
            for work in works:
                work.wait()

    @property
    def gathers_by_block(self):
        """--zero 3: a forward gathers each block from every replica's slice (mp.optim.runs_on_every_replica)."""
        return self.shards is not None

    def whole_params(self):
        """--zero 3: for a forward outside a step, each block gathered as it runs and freed after
        (mp.param_shards, by_block); else the weights always are whole."""
        return self.shards.by_block() if self.shards else contextlib.nullcontext()

    def every_param_whole(self):
        """--zero 3: every weight whole at once for what runs inside (mp.param_shards); else they always are."""
        return self.shards.whole() if self.shards else contextlib.nullcontext()

    def counting(self, phase):
        """--zero 3: the weights gathered inside counted as this phase's peak, not a step's (mp.param_shards)."""
        return self.shards.counting(phase) if self.shards else contextlib.nullcontext()

    def held_params(self):
        """The weights this replica holds between steps: --zero 3, its slices; else the whole model's."""
        return self.slices if self.shards else None

    def squares(self, counted=None):
        """This replica's share of the gradient norm: the squares of its slices' elements that belong to
        parameters this rank counts (mp.clipping.counted_grads' rule, piece by piece)."""
        rank = self.grads.rank
        pieces = [g[start:start + n] for b, g in zip(self.grads.buckets, self.grads.shard_grads)
                  for p, start, _, n in b.segments(rank) if counted is None or counted(p)]
        return grad_squares(pieces, self.slices[0].device if self.slices else "cpu")

    def saved_pieces(self, params):
        """[(kind, parameter, flat, tensor)]: what this replica writes in a checkpoint (mp.checkpoint), its
        slices only, nothing gathered: of each parameter its share of a bucket holds, the weights (--zero 3:
        its own copy, `mine`) and each kind of optimizer state as the flat range (first, count, shape) of
        the parameter; AdamW's step whole (every replica writes the same: DCP keeps one). A weight in no
        bucket (not trained) whole."""
        out, rank = [], self.grads.rank
        for b, mine in zip(self.grads.buckets, self.slices):
            state = optim.param_state(self.inner, mine)
            for p, start, first, n in b.segments(rank):
                flat = (first, n, tuple(p.shape))
                out.append(("param", p, flat, mine.detach()[start:start + n]))
                out += [(kind, p, None, t) if kind == "step" else (kind, p, flat, t[start:start + n])
                        for kind, t in state.items()]
        return out + [("param", p, None, p.detach()) for p in params if id(p) not in self.grads.where]

    def make_state(self, kinds):
        """Before a resume reads into them (mp.checkpoint, through saved_pieces): my slices' state of these
        kinds, as torch's step makes it (zeros; the step a float32 0-dim tensor on the CPU)."""
        for s in self.slices:
            state = self.inner.state[s]
            for kind in kinds:
                state[optim.TORCH_NAME.get(kind, kind)] = torch.zeros((), dtype=torch.float32) if kind == "step" \
                    else torch.zeros_like(s)

    def loaded(self):
        """A resume read my slices (of the weights too: saved_pieces): --zero 1, 2 put every replica's into
        the whole weights, as after an update (bytes a step does not send: not counted); --zero 3's next
        forward gathers them."""
        if not self.shards:
            sent = self.grads.sent_bytes
            self.share()
            self.grads.sent_bytes = sent

    def state_mb(self):
        return optim.optimizer_state_mb(self.inner)
