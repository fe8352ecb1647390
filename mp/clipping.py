"""Gradient clipping by the global norm of the full model's gradient, when no rank holds it all.

torch.nn.utils.clip_grad_norm_ in one process: norm = sqrt(sum of every gradient element squared),
then every gradient times min(1, max_norm / (norm + 1e-6)). Split over ranks, the norm is the same
sum taken in three parts:

    over pipeline stages       each stage sums its own parameters' squares; all-reduce over the pipeline
    over tensor-parallel ranks each rank sums its shards' squares; all-reduce over the tp group. A
                               replicated tensor (a norm, a row-parallel bias) is on every tp rank:
                               only tp rank 0 counts it, or it would count tp times
    over data-parallel ranks   nothing: the norm is taken after the gradients are averaged, when the
                               replicas hold the same gradient (the baseline's, of the whole batch);
                               under --zero 1 each replica holds a slice of it: all-reduce over them too

Every rank ends with the same norm and scales its own gradients by the same factor.

Nothing here reads a number back from the device: the norm stays a tensor, the clipping factor is
clamped on the device (torch.nn.utils.clip_grads_with_norm_), and the per-tensor norms are one foreach
kernel. Without clipping a step needs no norm at all, only for the log: each rank keeps its own sum
of squares, and the loop sums the steps' sums over the groups in one all-reduce when it writes the
log (finish_norms).
"""
import torch
import torch.distributed as dist


def grad_squares(grads, device="cpu"):
    """The sum of the squares of these gradients' elements, in float64: each tensor's norm as torch's
    clip_grad_norm_ takes it (float32, one foreach kernel for all, no squared copy of a gradient),
    then their squares summed in float64. A tensor; zero (on device) for no gradients."""
    grads = [g.detach() for g in grads]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().square().sum()


def counted_grads(params, counted=None):
    """The gradients this rank counts in the norm (counted(p): not a replica another rank counts)."""
    return [p.grad for p in params if p.grad is not None and (counted is None or counted(p))]


def sum_over(squares, groups):
    """Sum a tensor of sums of squares over each process group in `groups` (in place), one all-reduce each."""
    for group in groups:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)
    return squares


def device_of(params):
    return next((p.device for p in params), torch.device("cpu"))


def global_grad_norm(params, groups=(), counted=None):
    """The full model's gradient norm, a tensor on every rank."""
    params = list(params)
    return sum_over(grad_squares(counted_grads(params, counted), device_of(params)), groups).sqrt()


def clip_global(params, max_norm, groups=(), counted=None, squares=None):
    """With max_norm: the global norm (a tensor), and every gradient of params clipped to it. Without
    (None): this rank's sum of squares only, no collective; finish_norms turns it into the norm when
    the step is logged. squares: this rank's sum of squares when the caller took it (--zero 1's slices)."""
    params = list(params)
    if squares is None:
        squares = grad_squares(counted_grads(params, counted), device_of(params))
    if max_norm is None:
        return squares
    norm = sum_over(squares, groups).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)   # the factor clamped on the device
    return norm


def finish_norms(values, groups, clipped):
    """The logged norms of several steps from clip_global's values, stacked: without clipping they are
    each rank's sums of squares, summed over the groups for all the steps in one all-reduce per group."""
    return values if clipped else sum_over(values, groups).sqrt()
