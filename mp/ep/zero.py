"""ZeRO with experts (parallel_5d.py --zero 1, 2, 3 with --experts): two sets of slices, one optimizer.

A dense weight is held by every dp x cp rank of its stage, an expert only by its expert-data-parallel
(edp) ranks, so each has its own mp.zero.ZeroOptimizer over its own buckets: the dense ones sliced over
dp x cp, the experts' over edp. ZeroPair steps both and answers the loop and mp.checkpoint as one
optimizer. The gradient norm: each rank's squares of its dense slice and of its expert slice, summed over
dp x cp, which counts each once (dp x cp is the ep group times the edp group: the experts' slices are
summed over their edp replicas and over the ep ranks' different experts)."""
import contextlib

import torch.distributed as dist

from mp.buckets import GradBuckets
from mp.optim import make_optimizer
from mp.param_shards import ParamShards, weights_by_block
from mp.zero import ZeroOptimizer


class ZeroPair:
    def __init__(self, dense, experts):
        self.parts = [dense, experts]
        self.slices = dense.slices + experts.slices
        self.param_groups = dense.param_groups + experts.param_groups

    def zero_grad(self, set_to_none=True):
        for part in self.parts:
            part.zero_grad()

    def step(self):
        for part in self.parts:       # my slices of each, then each one's all-gather on its own group
            part.step()

    def squares(self, counted=None):
        return sum(part.squares(counted) for part in self.parts)

    @property
    def gathers_by_block(self):
        return any(part.gathers_by_block for part in self.parts)

    def whole_params(self):
        """--zero 3: each dense block and each expert gathered as it runs (over dp x cp, over edp)."""
        return self.each(lambda part: part.whole_params())

    def counting(self, phase):
        return self.each(lambda part: part.counting(phase))

    def every_param_whole(self):
        return self.each(lambda part: part.every_param_whole())

    def each(self, context):
        stack = contextlib.ExitStack()
        for part in self.parts:
            stack.enter_context(context(part))
        return stack

    def held_params(self):
        held = [part.held_params() for part in self.parts]
        return None if held[0] is None else held[0] + held[1]

    def saved_pieces(self, params):
        """Each part's slices (nothing whole: every trained weight is in one of the two)."""
        return self.parts[0].saved_pieces([]) + self.parts[1].saved_pieces([])

    def make_state(self, kinds):
        for part in self.parts:
            part.make_state(kinds)

    def loaded(self):
        for part in self.parts:
            part.loaded()

    def state_mb(self):
        return sum(part.state_mb() for part in self.parts)


# --zero 3: mp.param_shards gathers a unit's weights in its forward pre-hook, one bucket a unit. A block
# with a mixture of experts is two kinds of unit: its dense pieces (over dp x cp) and each expert (over edp).

def is_moe_block(block):
    return hasattr(getattr(block, "mlp", None), "router") and hasattr(block.mlp, "experts")


def dense_units(chunks):
    """Per chunk, the modules holding its dense weights, each one called in the forward, in forward order:
    a block; of a block with experts, its norms, attention and router."""
    return [[unit for block in chunk
             for unit in ([block.ln1, block.attn, block.ln2, block.mlp.router] if is_moe_block(block) else [block])]
            for chunk in chunks]


def expert_units(chunks):
    """Per chunk, its experts (each called once a microbatch, in the order they run)."""
    return [[expert for block in chunk if is_moe_block(block) for expert in block.mlp.experts.values()]
            for chunk in chunks]


def mesh_optimizer(params, grads, shards, experts, args):
    """parallel_5d.py's optimizer: torch's over params; --zero: mp.zero's over my slices of the dense buckets
    (grads, and --zero 3's shards), and with experts a second one over my slices of theirs (experts: its
    ExpertGrads, whose buckets and shards are None without experts), stepped together (ZeroPair)."""
    if not args.zero:
        return make_optimizer(params, args)
    dense = ZeroOptimizer(grads, args, shards)
    return ZeroPair(dense, ZeroOptimizer(experts.buckets, args, experts.shards)) if experts.buckets else dense


class ExpertGrads:
    """The experts' gradients, in buckets over the expert-data-parallel group (mp.buckets: all-reduced,
    --zero 1, 2: reduce-scattered, and divided by the edp size D*C*T/N), then by N/T: the all-to-all's backward
    summed each expert's gradient over the N ep ranks' tokens and the T tp ranks hold disjoint runs of them, so
    the mean over the D*C ranks is the sum over edp / (D*C). / edp size only counts the ep sum twice (Megatron
    #5956, torchtitan #1551); tests/test_5d.py puts it back."""

    def __init__(self, params, mesh, args, runner, late, direct):
        waiting = (f"rank {dist.get_rank()} waited for the experts' all-reduce, ranks {mesh.peers('edp')}",
                   args.timeout_s)
        self.params, self.ep_sum, self.buckets, self.shards = params, mesh.ep_size / mesh.tp_size, None, None
        if params:   # --zero 3: a bucket an expert, gathered over edp before it runs (mp/ep/zero.py)
            units = expert_units(runner.chunks)
            self.buckets = GradBuckets(params, mesh.edp_group, waiting, shard=args.zero >= 1, recorder=runner,
                                       bucket_mb=args.bucket_mb, late=late, direct=direct, free=args.zero >= 2,
                                       groups=weights_by_block(units) if args.zero == 3 else None)
            self.shards = ParamShards(units, self.buckets, args.zero3_gather) if args.zero == 3 else None

    def zero_grad(self, step):
        if self.buckets:
            self.buckets.zero_grad(step)

    def average(self):
        """After the backward (and the tp sums): every bucket started (the runner told them as it told the
        dense ones: BucketSets), the late ones now, all waited, / N."""
        if self.buckets:
            self.buckets.final_late()
            self.buckets.wait()   # my slices (--zero 1-3), or every whole bucket
            for g in self.buckets.shard_grads if self.buckets.sharded else [b.grad for b in self.buckets.buckets]:
                g /= self.ep_sum
