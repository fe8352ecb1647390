"""The backward split in two for zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism"): B, the gradient of a stage's input, which the stage before waits for, and W, the
gradient of its weights, which nobody waits for and which schedules.py's zb therefore moves into
the pipeline's idle ticks.

For y = x A^T + b (a Linear), the backward is two products with the output's gradient dy:

    B: dx = dy A          needed upstream now         (and db = sum of dy: tiny, taken here too)
    W: dA = dy^T x        needed only by the optimizer step, so it can wait

split_weight_grads(chunk) replaces each nn.Linear and nn.Conv2d of a chunk by its split twin,
which holds the very same parameter objects (same names, same optimizer state, same checkpoint
keys) and differs only in its backward: it returns dx and db at once and leaves (x, dy) in the
chunk's WeightGradStash. The W action of that microbatch hands dA back to autograd, which adds it
to A.grad exactly as an unsplit backward would, gradient hooks included. Other parameters (norms,
embeddings) take their gradients in B, as before.

    stash = split_weight_grads(chunk)    # once: the chunk's Linear and Conv2d layers now split
    with stash.backward_of(mb):          # B: autograd.backward through the chunk
        torch.autograd.backward(y, dy)
    stash.weight_grads(mb)               # W: later, A.grad += dA for every split layer
"""
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F


class _InputGradOnly(torch.autograd.Function):
    """forward: the layer's own op. backward: dx (if anything reads it) and db now; (x, dy) to the
    stash; the weight (given detached) gets nothing until W."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return layer.op(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        layer.stash.put(layer, x, dy)
        # the first stage's first layer reads the images, which need no gradient: skip its product
        dx = layer.input_grad(x.shape, weight, dy) if ctx.needs_input_grad[0] else None
        return dx, None, layer.bias_grad(dy) if ctx.has_bias else None, None


class _DeferredWeightGrad(torch.autograd.Function):
    """forward: a zero, tied to the weight. backward: dA from B's (x, dy). Running autograd on it
    in W makes autograd itself accumulate dA into A.grad and fire A's hooks (data parallelism's)."""

    @staticmethod
    def forward(ctx, weight, x, dy, layer):
        ctx.save_for_backward(x, dy)
        ctx.layer = layer
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        x, dy = ctx.saved_tensors
        return ctx.layer.weight_grad(x, dy), None, None, None


class SplitLinear(nn.Module):
    """Takes an nn.Linear's place, with its parameters; its backward defers dA to W."""

    def __init__(self, layer, stash):
        super().__init__()
        self.register_parameter("weight", layer.weight)
        self.register_parameter("bias", layer.bias)
        self.stash = stash

    def forward(self, x):
        if not torch.is_grad_enabled():           # evaluation, --recompute's first forward
            return self.op(x, self.weight, self.bias)
        # the weight goes in detached: B then has no edge to it at all, so autograd neither touches
        # A.grad nor fires A's hooks with an empty gradient; W is the one that reaches A
        return _InputGradOnly.apply(x, self.weight.detach(), self.bias, self)

    def op(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def input_grad(self, shape, weight, dy):
        return dy @ weight

    def bias_grad(self, dy):
        return dy.reshape(-1, dy.shape[-1]).sum(0)

    def weight_grad(self, x, dy):
        return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class SplitConv2d(SplitLinear):
    """Takes an nn.Conv2d's place, with its parameters and geometry; its backward defers dA to W."""

    def __init__(self, layer, stash):
        super().__init__(layer, stash)
        if layer.padding_mode != "zeros":
            raise ValueError("the split convolution pads with zeros only")
        self.geometry = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups)

    def op(self, x, weight, bias):
        return F.conv2d(x, weight, bias, **self.geometry)

    def input_grad(self, shape, weight, dy):
        return torch.nn.grad.conv2d_input(shape, weight, dy, **self.geometry)

    def bias_grad(self, dy):
        return dy.sum((0, 2, 3))

    def weight_grad(self, x, dy):
        return torch.nn.grad.conv2d_weight(x, self.weight.shape, dy, **self.geometry)


SPLIT = {nn.Linear: SplitLinear, nn.Conv2d: SplitConv2d}


def split_weight_grads(chunk):
    """Replace every plain nn.Linear and nn.Conv2d in chunk by its split twin; return their stash."""
    stash = WeightGradStash()
    for parent in list(chunk.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in SPLIT:              # exact types: tensor-parallel shards are not these
                setattr(parent, name, SPLIT[type(child)](child, stash))
    return stash


class WeightGradStash:
    """What W needs, per microbatch: (layer, input, output gradient) of every split layer of one
    chunk, detached (so no autograd graph outlives its B), from B until that microbatch's W."""

    def __init__(self):
        self.pending = {}                         # microbatch -> [(layer, x, dy)], in backward order
        self.microbatch = None                    # the microbatch whose B is running

    def put(self, layer, x, dy):
        assert self.microbatch is not None, "a split layer's backward ran outside a B action"
        self.pending.setdefault(self.microbatch, []).append((layer, x.detach(), dy.detach()))

    @contextmanager
    def backward_of(self, mb):
        self.microbatch = mb
        try:
            yield
        finally:
            self.microbatch = None

    def weight_grads(self, mb):
        """W: dA of every split layer for microbatch mb, accumulated by autograd into A.grad."""
        zeros = [_DeferredWeightGrad.apply(layer.weight, x, dy, layer) for layer, x, dy in self.pending.pop(mb, [])]
        if zeros:
            torch.autograd.backward(zeros)
