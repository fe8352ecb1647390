"""parallel_5d.py's load-balancing loss (its gradient, and its value in the log), and the routing record of every stage in its summary.

The summary's tokens_per_expert and dropped_per_step (mp.moe.expert_load) are read off the MoE layers of
the model the logging rank holds: with a pipeline, its own stage's only. After the last step every rank
of a pipeline sends the records of its layers (already on the host: a few ints a step and layer) to the
others, and each puts the layers it lacks into its model as records without weights, at their block's
place, so expert_load lists every block in order, as the baseline's does."""
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn

from mp.moe import LoadRecord, moe_layers, read_load


class WithAuxLoss(torch.autograd.Function):
    """Forward: the MoE's output, unchanged. Backward: also a gradient of 1 into the (scaled) load-
    balancing loss share. A pipeline stage differentiates only its output, so a loss made in the middle
    of a stage (parallel_5d.FoldedMoE's) rides on the activation, as Megatron's MoEAuxLossAutoScaler does."""

    @staticmethod
    def forward(ctx, y, aux):
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


class RemoteLoad(nn.Module):
    """Another stage's MoE layer's routing record: no weights, never run."""

    def __init__(self, routed, dropped):
        super().__init__()
        self.aux_loss, self.load = None, LoadRecord()
        self.load.routed, self.load.dropped = routed, dropped


def complete_routing(model, pp_group):
    """A collective over the pipeline: every block's routing record, in block order, in every rank's model."""
    read_load(model)                                     # mine to the host (one read)
    mine = {name: (m.load.routed, m.load.dropped) for name, block in model.named_children()
            for m in moe_layers(block)}
    every = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, mine, group=pp_group)
    for theirs in every:
        for name, (routed, dropped) in theirs.items():
            if name not in model._modules:
                model._modules[name] = RemoteLoad(routed, dropped)
    model._modules = OrderedDict(sorted(model._modules.items(), key=lambda item: int(item[0])))


def aux_loss_total(model, mesh, args):
    """The load-balancing loss of the step for the log: my shares (each microbatch's, / M; the MoE layers keep
    them in `shares`), summed over every rank holding a part of the tokens (dp x cp x tp: parallel_5d.py's
    FoldedMoE gives each tp rank its own run of them) and over the stages (each its own blocks). None for a
    dense model. Every rank takes part, a stage without MoE blocks too."""
    if not args.experts:
        return None
    layers = [m for m in model.modules() if hasattr(m, "shares")]
    shares = [s for m in layers for s in m.shares]
    for m in layers:
        m.shares = []
    none = torch.zeros((), device=next(model.parameters()).device)
    total = torch.stack(shares).sum() / args.microbatches if shares else none
    for group in [mesh.dp_cp_group, mesh.tp_group, mesh.pp_group]:   # (tp: each tp rank routes its own tokens)
        dist.all_reduce(total, group=group)
    return total
