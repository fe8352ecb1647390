"""mp/dropout.py's keyed masks against a slow reference, and what a forward costs the device.

The reference hashes each element's coordinates in plain Python (lowbias32 written out again, with
% instead of masks); the previous tensor implementation (kept in benchmarks/dropout_cost.py) must
draw the same bits too, so every run logged before the 2026-11-25 rewrite stays reproducible.
The forward must copy nothing from the host (its key is a Python scalar), keep one int64 buffer of
the activation's size plus one scratch, and leave autograd only the bool mask to save."""
import itertools
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import ROOT
from mp.dropout import DropoutKeys, KeyedDropout, keep_mask, mix, mix_

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from dropout_cost import keep_mask_before, keyed_before  # noqa: E402

P = 0.5


def lowbias32(x):
    x ^= x >> 16
    x = x * 0x7FEB352D % 2**32
    x ^= x >> 15
    x = x * 0x846CA68B % 2**32
    return x ^ (x >> 16)


def reference_keep(seed, step, layer, sample, element, p):
    h = lowbias32(seed % 2**32)
    for coordinate in (step % 2**32, layer, sample % 2**32, element % 2**32):
        h = lowbias32(h ^ coordinate)
    return h >= int(p * 2**32)


def reference_mask(shape, seed, step, layer, first_sample=0, shard=None, first_token=0):
    """Bool mask of a local activation of `shape`, element by element from its place in the full
    layer: features start.. of `full` (shard), tokens first_token.. along dimension 1."""
    start, full = shard or (0, shape[-1])
    dims = list(shape[1:-1]) + [full]               # the full layer's sizes (the first one is never used)
    keep = torch.zeros(shape, dtype=torch.bool)
    for index in itertools.product(*map(range, shape)):
        where = list(index[1:])
        where[-1] += start
        if len(where) > 1:
            where[0] += first_token
        element = 0
        for coordinate, size in zip(where, dims):
            element = element * size + coordinate
        keep[index] = reference_keep(seed, step, layer, first_sample + index[0], element, P)
    return keep


LAYOUTS = [   # shape, first_sample, shard, first_token
    ((6, 4, 12), 0, None, 0),              # the whole activation
    ((3, 4, 12), 5, None, 0),              # a microbatch or a data-parallel slice
    ((4, 4, 4), 0, (5, 12), 0),            # a tensor-parallel feature shard (uneven)
    ((5, 30), 2, (30, 64), 0),             # the mlp after a column-parallel layer
    ((4, 2, 12), 0, None, 1),              # a sequence-parallel token shard
    ((4, 2, 4), 3, (8, 12), 2),            # both
    ((4, 16, 5, 5), 7, None, 0),           # the cnn's feature map
    ((2, 2, 3, 6), 0, (6, 12), 1),         # tokens and features cut in a 4-D activation
]
KEYS = [(0, 0, 0), (3, 11, 7), (-5, 2**33 + 1, 2), (2**40 + 9, 123456, 31)]   # seed, step, layer


def dropout_layer(keys, layer, shard, first_token):
    module = KeyedDropout(P, layer=layer, keys=keys)
    module.shard, module.first_token = shard, first_token
    return module


@pytest.mark.parametrize("shape,first_sample,shard,first_token", LAYOUTS)
@pytest.mark.parametrize("seed,step,layer", KEYS)
def test_the_mask_is_the_reference_bit_for_bit(shape, first_sample, shard, first_token, seed, step, layer):
    keys, x = DropoutKeys(seed), torch.randn(shape)
    with keys.training(step, first_sample):
        out = dropout_layer(keys, layer, shard, first_token)(x)
    want = reference_mask(shape, seed, step, layer, first_sample, shard, first_token)
    assert 0.3 < want.float().mean() < 0.7 or want.numel() < 50
    assert torch.equal(out != 0, want)
    assert torch.equal(out[want], x[want] * 2.0)                  # kept: x / (1 - p), exactly


def test_the_int_mix_the_tensor_mix_and_the_reference_agree():
    values = [0, 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    values += torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    h = torch.tensor(values)
    mix_(h, torch.empty_like(h))
    assert h.tolist() == [mix(v) for v in values] == [lowbias32(v) for v in values]


def test_masks_and_gradients_equal_the_previous_implementation():
    """On the vit's activation and on random coordinates up to 2^33 (masked to 32 bits alike)."""
    g = torch.Generator().manual_seed(1)
    for seed, step, layer in KEYS:
        samples, elements = torch.randint(0, 2**33, (9,), generator=g), torch.randint(0, 2**33, (500,), generator=g)
        assert torch.equal(keep_mask(seed, step, layer, samples, elements, 0.3),
                           keep_mask_before(seed, step, layer, samples, elements, 0.3))
    keys, grad = DropoutKeys(seed=4), torch.randn(64, 64, 128)
    outs, grads = [], []
    for forward in (KeyedDropout(0.1, layer=3, keys=keys), lambda x: keyed_before(x, keys, 3, 0.1)):
        x = torch.randn(64, 64, 128, generator=torch.Generator().manual_seed(2)).requires_grad_()
        with keys.training(step=9, first_sample=128):
            out = forward(x)
        out.backward(grad)
        outs.append(out.detach())
        grads.append(x.grad)
    assert torch.equal(*outs) and torch.equal(*grads)


class OpLog(TorchDispatchMode):
    """Every aten op run under it, with its arguments and result."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, list(args) + list((kwargs or {}).values()), out))
        return out


COPIES = {"_to_copy", "copy_", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense"}


def host_traffic(log, device):
    """The ops that copy or read a tensor, or take a tensor that is not on `device`."""
    return [str(func) for func, args, _ in log.ops
            if func.__name__.split(".")[0] in COPIES
            or any(isinstance(a, torch.Tensor) and a.device.type != device for a in args)]


def logged_forward(forward, shape, device):
    keys, log = DropoutKeys(seed=3), OpLog()
    x = torch.ones(shape, device=device)
    with keys.training(step=5, first_sample=2), log:
        forward(keys, x)
    return log, x.numel()


@pytest.mark.parametrize("shape,first_sample,shard,first_token", LAYOUTS)
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_forward_copies_nothing_from_the_host(shape, first_sample, shard, first_token, device):
    """On the meta device a tensor made on the host shows as a CPU argument (the old key did, then
    went through _to_copy); on the CPU nothing may be made from a Python value or read back."""
    log, _ = logged_forward(lambda keys, x: dropout_layer(keys, 7, shard, first_token)(x), shape, device)
    assert host_traffic(log, device) == []
    old, _ = logged_forward(lambda keys, x: keyed_before(x, keys, 7, P), shape, device)
    assert host_traffic(old, device) != []                        # the check sees the old key's copy


def int64_buffers(log, numel):
    """Fresh int64 tensors of the activation's size: neither written in place nor views."""
    return sum(1 for func, _, out in log.ops
               if not func._schema.is_mutable and all(r.alias_info is None for r in func._schema.returns)
               and isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.numel() == numel)


@pytest.mark.parametrize("shape,first_sample,shard,first_token", LAYOUTS)
def test_the_hash_runs_in_one_buffer_and_one_scratch(shape, first_sample, shard, first_token):
    log, numel = logged_forward(lambda keys, x: dropout_layer(keys, 7, shard, first_token)(x), shape, "meta")
    assert int64_buffers(log, numel) == 2
    old, numel = logged_forward(lambda keys, x: keyed_before(x, keys, 7, P), shape, "meta")
    assert int64_buffers(old, numel) > 10                         # each of the old mix's steps made one


def test_backward_keeps_only_the_bool_mask():
    keys, saved = DropoutKeys(seed=0), []
    x = torch.randn(8, 4, 12, requires_grad=True)
    with keys.training(step=1), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                          lambda t: t):
        out = dropout_layer(keys, 0, (12, 24), 0)(x)
    assert [(t.dtype, t.shape) for t in saved] == [(torch.bool, x.shape)]
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, torch.where(saved[0], 2.0, 0.0))
