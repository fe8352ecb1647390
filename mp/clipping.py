"""Gradient clipping by the global norm of the full model's gradient, when no rank holds it all.

torch.nn.utils.clip_grad_norm_ in one process: norm = sqrt(sum of every gradient element squared),
then every gradient times min(1, max_norm / (norm + 1e-6)). Split over ranks, the norm is the same
sum taken in three parts:

    over pipeline stages       each stage sums its own parameters' squares; all-reduce over the pipeline
    over tensor-parallel ranks each rank sums its shards' squares; all-reduce over the tp group. A
                               replicated tensor (a norm, a row-parallel bias) is on every tp rank:
                               only tp rank 0 counts it, or it would count tp times
    over data-parallel ranks   nothing: the norm is taken after the gradients are averaged, when the
                               replicas hold the same gradient (the baseline's, of the whole batch)

Every rank ends with the same norm and scales its own gradients by the same factor.
"""
import math

import torch
import torch.distributed as dist


def global_grad_norm(params, groups=(), counted=None):
    """The full model's gradient norm: this rank's sum of squares (over the parameters counted(p)
    says it counts), summed over each process group in `groups`. A tensor on every rank."""
    grads = [p.grad for p in params if p.grad is not None and (counted is None or counted(p))]
    device = next((p.device for p in params), torch.device("cpu"))
    # each tensor's norm as torch's clip_grad_norm_ takes it (float32, no squared copy of a gradient:
    # that copy, in float64, once cost a stage 100 MB), then their squares summed in float64
    squares = torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads]).double().square().sum() if grads \
        else torch.zeros((), dtype=torch.float64, device=device)
    for group in groups:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
    return squares.sqrt()


def clip_by_norm_(params, norm, max_norm):
    """Scale the gradients as clip_grad_norm_ does, given the global norm (max_norm None: leave them)."""
    if max_norm is None:
        return
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def clip_global(params, max_norm, groups=(), counted=None):
    """Global norm, then clipping; returns the norm before clipping (a float, the `grad_norm` logged)."""
    params = list(params)
    norm = global_grad_norm(params, groups, counted).item()
    if not math.isfinite(norm):
        return norm
    clip_by_norm_(params, norm, max_norm)
    return norm
