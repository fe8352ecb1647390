"""Which parameters are shards and which are replicas, and how the replicas stay whole and identical:
a room of its own, as every axis needs it (tensor, context and expert parallelism, the 3-D program,
mp.check, mp.checkpoint, mp.tp.*), not only tensor parallelism, which first did.

A sharded layer records, for each parameter it sliced, where the slice lies in the full tensor
(`shards`: dim, start, length). Every other parameter is replicated: row-parallel biases, norms, the
vit's embedding and head. A replica's gradient is either whole on every rank already (computed from
whole, identical tensors: ReplicatedGrads keeps a GPU's from drifting by a last bit), or a
partial sum that the ranks add up (SummedGradients: --hybrid's convolutions, the norms under
--sequence-parallel). The gradient norm counts each replica once (counted_once).
"""
import torch.distributed as dist

from mp.dist import all_reduce_flat
from mp.models import shard_of


def group_rank(group):
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def replicated_parameters(model):
    """The parameters every tp rank holds whole: row-parallel biases, norms, (vit) embedding and head; not a
    parameter that each tp rank holds a different one of (not_tp_replicas: parallel_5d.py's experts)."""
    return [p for name, p in model.named_parameters()
            if shard_of(model, name) is None and getattr(p, "tp_replica", True)]


def not_tp_replicas(*params):
    """These parameters are whole but each tp rank's its own (an expert folded over tp): no tp sum or average,
    and the gradient norm counts each on the rank that holds it."""
    for p in params:
        p.tp_replica = False


class ReplicatedGrads:
    """Keep the replicated parameters identical on a GPU. Their gradients are computed from whole,
    identical tensors on every rank, so on the CPU they are bit-identical; but GPU kernels (cuDNN's
    among them) may sum in another order from run to run, and a last-bit difference would make the
    replicas drift apart. So average() averages them over the group, once a step after the last
    backward (a pipeline runs one backward per microbatch: averaging after each would only repeat
    the traffic), flattened into buckets (mp.dist.all_reduce_flat)."""

    def __init__(self, model, group):
        # --hybrid's convolutions and sequence-parallel norms are summed into one whole gradient
        # already (SummedGradients, made first): a second all-reduce would only repeat the traffic
        self.params = [p for p in replicated_parameters(model) if not getattr(p, "summed_over_ranks", False)]
        self.group = group

    def average(self):
        grads, size = [p.grad for p in self.params if p.grad is not None], group_size(self.group)
        if grads and size > 1:
            all_reduce_flat(grads, self.group, divide_by=size)


def average_replicated_grads(model, group, device):
    """The ReplicatedGrads of model on a GPU; None on the CPU, where the gradients are identical already."""
    return ReplicatedGrads(model, group) if device.type == "cuda" else None


def counted_once(model, group):
    """For the gradient norm (clipping.py): a shard counts on the rank that holds it, a replicated
    tensor on rank 0 of the group only (every rank of it holds the same one; under sequence parallelism the
    LayerNorms' partial gradients are summed before the norm is taken: whole again)."""
    replicated, first = {id(p) for p in replicated_parameters(model)}, group_rank(group) == 0
    return lambda p: first or id(p) not in replicated


class SummedGradients:
    """Replicated parameters that each rank applied to part of the data (--hybrid's convolutions to a
    slice of the batch, a norm under --sequence-parallel to a slice of the tokens): their gradients
    summed over the group, flattened into buckets (mp.dist.all_reduce_flat: DDP's buckets, without
    their overlap). Summed, not averaged: the loss is already the mean over the global batch, so each
    rank's gradient is its part's share of the full one. The step calls sum() once, after its last
    backward (a pipeline runs one backward per microbatch: summing after each would add the earlier
    microbatches' sums again)."""

    def __init__(self, params, group):
        self.params, self.group = list(params), group
        for p in self.params:
            p.summed_over_ranks = True        # whole and identical after the sum: ReplicatedGrads skips it

    def sum(self):
        grads = [p.grad for p in self.params if p.grad is not None]   # the same on every rank of the group
        if grads and group_size(self.group) > 1:
            all_reduce_flat(grads, self.group)
