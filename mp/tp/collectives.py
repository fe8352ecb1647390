"""The three collectives under tensor_parallel.py's operators, over one tensor-parallel group.

all_reduce (every rank gets the sum), reduce_scatter (every rank gets its slice of the sum) and
all_gather (every rank gets every rank's slice): all_reduce = reduce_scatter + all_gather, which is
why sequence parallelism costs the bytes of the all-reduce it replaces. Each returns its input
unchanged on a group of one (or without a process group: a one-process test), so a layer of degree 1
is the plain layer.

The gather and the scatter run on one flat buffer each (ALL_GATHER, REDUCE_SCATTER: torch's
all_gather_into_tensor and reduce_scatter_tensor, as mp.dp_collectives names them), not on a list of
parts: one allocation and at most one copy into place, where a list costs one tensor a rank and a
cat. gloo implements both (checked on torch 2.14.1), with the parts laid end to end along dim 0
(it refuses them stacked in a new dim), which is the layout used here.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp.dp_collectives import ALL_GATHER, REDUCE_SCATTER


def tp_rank(group):
    return dist.get_rank(group) if dist.is_initialized() else 0


def tp_size(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(x, group, in_place=False):
    """The sum of x over the group. in_place=True: the caller owns x (nothing else holds it), so it is
    summed where it lies; otherwise, or if x is not contiguous, a contiguous copy is summed."""
    if tp_size(group) == 1:
        return x
    if not (in_place and x.is_contiguous()):
        x = x.clone(memory_format=torch.contiguous_format)   # autograd may hold x (a gradient can be shared)
    dist.all_reduce(x, group=group)
    return x


def reduce_scatter(x, group, dim):
    """Sum x over the group and keep my equal slice along dim: half an all-reduce (its other half is an
    all-gather). dim must split evenly (sequence parallelism's tokens do: mp.tp.flags checks it)."""
    size = tp_size(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    # rank r's slice along dim becomes the r-th block along dim 0, as the flat collective wants it:
    # one copy (none when dim is 0 and x is contiguous), where x.chunk needed one per part
    parts = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()
    out = parts.new_empty(parts.shape[1:])
    REDUCE_SCATTER(out, parts.flatten(0, 1), group=group)
    return out


def all_gather(x, group, sizes, dim):
    """Every rank's shard, concatenated along dim. Shards may differ by one (tensor_split) and the
    collective needs equal sizes, so a shorter shard is padded to the largest and the padding is cut."""
    if tp_size(group) == 1:
        return x
    dim, most = dim % x.dim(), max(sizes)
    if x.shape[dim] < most:
        x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, most - x.shape[dim]])
    x = x.contiguous()
    flat = x.new_empty((len(sizes) * x.shape[0], *x.shape[1:]))
    ALL_GATHER(flat, x, group=group)
    parts = flat.view(len(sizes), *x.shape)                    # parts[r]: rank r's shard, padded
    if min(sizes) < most:                                      # uneven: cut each part's padding
        return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)
    # parts[r] goes r-th along dim: along dim 0 the buffer is the answer already (a view), elsewhere one copy
    return parts.movedim(0, dim).flatten(dim, dim + 1)
