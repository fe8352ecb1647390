"""The tensor-parallel operators beyond f and g, which --hybrid, --sequence-parallel and parallel_3d.py's
cuts need: autograd functions around one collective of mp.tp.collectives each, forward and backward
each other's conjugate. f (copy_to_tp_region) and g (reduce_from_tp_region) are the lesson's, in
tensor_parallel.py.

    gather_from_tp_region                    forward all-gather of the shards    backward keep my slice
    split_to_sequence_parallel_region        forward keep my tokens              backward all-gather
    gather_from_sequence_parallel_region     forward all-gather of the tokens    backward reduce-scatter
    reduce_scatter_to_sequence_parallel_region  forward reduce-scatter           backward all-gather
"""
import torch

from mp.tp.collectives import all_gather, reduce_scatter, tp_rank, tp_size


class _GatherFromTP(torch.autograd.Function):
    """Forward all-gather (shards -> whole tensor); backward split (keep this rank's slice of the whole gradient)."""

    @staticmethod
    def forward(ctx, x, group, sizes, dim):
        ctx.start, ctx.size, ctx.dim = sum(sizes[:tp_rank(group)]), x.shape[dim], dim
        return all_gather(x, group, sizes, dim)

    @staticmethod
    def backward(ctx, grad):
        # no communication: what follows the gather is replicated, so every rank holds the same whole gradient
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence parallel, before a column-parallel layer: forward all-gather of the token shards; backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, [x.shape[1]] * tp_size(group), 1)

    @staticmethod
    def backward(ctx, grad):
        # each rank's column shard gives a partial gradient of every token: sum them, keep my tokens'
        return reduce_scatter(grad, ctx.group, 1), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallel, after a row-parallel layer: forward reduce-scatter (sum, keep my tokens); backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, [grad.shape[1]] * tp_size(ctx.group), 1), None


class _SplitToSequence(torch.autograd.Function):
    """Whole tokens on every rank -> my run of them (parallel_5d.py's mixture of experts under tp without sequence
    parallelism, so that each token is routed by one tp rank): forward keep my tokens, no communication; backward
    all-gather (each rank computed the gradient of its own tokens only)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, size = group, x.shape[1] // tp_size(group)
        return x.narrow(1, tp_rank(group) * size, size).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, [grad.shape[1]] * tp_size(ctx.group), 1), None


def split_to_sequence_parallel_region(x, group):
    return _SplitToSequence.apply(x, group)


def gather_from_tp_region(x, group, sizes, dim=-1):
    return _GatherFromTP.apply(x, group, sizes, dim)


def gather_from_sequence_parallel_region(x, group):
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequence.apply(x, group)
