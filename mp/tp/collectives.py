"""The three collectives under tensor_parallel.py's operators, over one tensor-parallel group.

all_reduce (every rank gets the sum), reduce_scatter (every rank gets its slice of the sum) and
all_gather (every rank gets every rank's slice): all_reduce = reduce_scatter + all_gather, which is
why sequence parallelism costs the bytes of the all-reduce it replaces. Each returns its input
unchanged on a group of one (or without a process group: a one-process test), so a layer of degree 1
is the plain layer.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def tp_rank(group):
    return dist.get_rank(group) if dist.is_initialized() else 0


def tp_size(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(x, group):
    if tp_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # in place below; autograd may hold x (a gradient can be shared)
    dist.all_reduce(x, group=group)
    return x


def reduce_scatter(x, group, dim):
    """Sum x over the group and keep my equal slice along dim: half an all-reduce (its other half is an
    all-gather). gloo implements reduce_scatter (checked on torch 2.15), so no all-reduce stands in."""
    if tp_size(group) == 1:
        return x
    parts = [part.contiguous() for part in x.chunk(tp_size(group), dim)]
    out = torch.empty_like(parts[tp_rank(group)])
    dist.reduce_scatter(out, parts, group=group)
    return out


def all_gather(x, group, sizes, dim):
    """Every rank's shard, concatenated along dim. Shards may differ by one (tensor_split) and gloo's
    all_gather needs equal sizes, so each rank pads its shard to the largest and the padding is cut."""
    if tp_size(group) == 1:
        return x
    dim = dim % x.dim()
    padded = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, max(sizes) - x.shape[dim]]).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)
