"""Gradient readiness is said, not inferred (mp/buckets.py, issue 42): the code that runs the backward
calls GradBuckets.final once it is done with a parameter. A parameter accumulated a different number
of times from one step to the next (a branch taken by more microbatches, an expert of a mixture) gets
exactly the update a plain all-reduce after the backward gives; a bucket said final too early, or
never, stops with one error naming the parameter, never a silently different mean."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import run_ranks
from mp.buckets import BucketError, GradBuckets


def model_of(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))


def backwards(model, rank, step, uses):
    """`uses` backwards of this step (the count changes from step to step), each on its own data."""
    for use in range(uses):
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + use)
        model(torch.randn(4, 6, generator=g)).square().mean().backward()


def _changing_counts_case(rank, world, group):
    bucketed, plain = model_of(), model_of()
    # 64 bytes a bucket: the four tensors fall into several buckets, started at different times
    grads = GradBuckets(list(bucketed.parameters()), None, ("the test's all-reduce", 30), bucket_mb=64 / 2**20)
    grads.name_params(bucketed.named_parameters())
    assert len(grads.buckets) > 1
    for step, uses in enumerate([1, 3, 2]):                      # the accumulation count changes
        grads.zero_grad()
        for p in plain.parameters():
            p.grad = None
        backwards(bucketed, rank, step, uses)
        grads.final(list(bucketed.parameters()))                 # said once the last backward is done
        grads.wait()
        backwards(plain, rank, step, uses)
        for p in plain.parameters():                             # the reference: all-reduce after the backward
            dist.all_reduce(p.grad)
            p.grad /= world
        for (name, a), b in zip(bucketed.named_parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), (step, name, (a.grad - b.grad).abs().max())
            with torch.no_grad():                                # the same update on both
                a -= 0.1 * a.grad
                b -= 0.1 * b.grad


def test_a_changing_accumulation_count_gives_the_plain_all_reduce(tmp_path):
    run_ranks(_changing_counts_case, 2, tmp_path)


def _said_too_early_case(rank, world, group):
    model = model_of()
    grads = GradBuckets(list(model.parameters()), None, ("the test's all-reduce", 30))
    grads.name_params(model.named_parameters())
    grads.zero_grad()
    backwards(model, rank, 0, 1)
    grads.final(list(model.parameters()))                        # said final, then another backward
    backwards(model, rank, 0, 1)
    with pytest.raises(BucketError, match=r"a gradient of 2\.(weight|bias) arrived after its bucket's all-reduce"):
        grads.wait()
    grads.zero_grad()                                            # a new step: and a bucket never said final
    backwards(model, rank, 1, 1)
    grads.final([p for name, p in model.named_parameters() if name != "0.weight"])
    with pytest.raises(BucketError, match=r"the gradient of 0\.weight was never said final"):
        grads.wait()


def test_a_gradient_said_final_too_early_or_never_is_an_error(tmp_path):
    run_ranks(_said_too_early_case, 2, tmp_path)
