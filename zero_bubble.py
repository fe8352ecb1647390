"""The backward split in two for zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism"): B, the gradient of a stage's input, which the stage before waits for, and W, the
gradient of its weights, which nobody waits for and which schedules.py's zb therefore moves into
the pipeline's idle ticks.

For y = x A^T + b (a Linear), the backward is two products with the output's gradient dy:

    B: dx = dy A          needed upstream now         (and db = sum of dy: tiny, taken here too)
    W: dA = dy^T x        needed only by the optimizer step, so it can wait

A Linear or Conv2d of a split chunk runs its forward through an autograd Function whose backward
returns dx (and db) at once and leaves (x, dy) in the chunk's WeightGradStash; the W action of
that microbatch computes dA from them later, under no_grad, and adds it to A.grad as autograd
would have. Other parameters (norms, embeddings) take their gradients in B, as before.

    stash = WeightGradStash(chunk)       # once: the chunk's Linear and Conv2d layers now split
    with stash.backward_of(mb):          # B: autograd.backward through the chunk
        torch.autograd.backward(y, dy)
    stash.weight_grads(mb)               # W: later, A.grad += dA for every split layer
"""
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F


class _InputGradLinear(torch.autograd.Function):
    """forward: F.linear. backward: dx = dy A and db now; (x, dy) to the stash for dA later."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        ctx.layer.stash.put(ctx.layer, x, dy)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        # the first stage's first layer reads the images, which need no gradient: skip its matmul
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        return dx, None, db, None                # None for the weight: autograd leaves its .grad alone


class _InputGradConv2d(torch.autograd.Function):
    """forward: the layer's conv2d. backward: dx and db now; (x, dy) to the stash for dA later."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return F.conv2d(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        layer.stash.put(layer, x, dy)
        dx = torch.nn.grad.conv2d_input(x.shape, weight, dy, layer.stride, layer.padding, layer.dilation,
                                        layer.groups) if ctx.needs_input_grad[0] else None
        return dx, None, dy.sum((0, 2, 3)) if ctx.has_bias else None, None


class SplitLinear(nn.Linear):
    """An nn.Linear whose backward defers dA to a W action while its stash is active."""

    def forward(self, x):
        if self.stash is None or not self.stash.active or not torch.is_grad_enabled():
            return super().forward(x)             # evaluation, or a copy made for --check's reference
        return _InputGradLinear.apply(x, self.weight, self.bias, self)

    def weight_grad(self, x, dy):
        return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class SplitConv2d(nn.Conv2d):
    """An nn.Conv2d whose backward defers dA to a W action while its stash is active."""

    def forward(self, x):
        if self.stash is None or not self.stash.active or not torch.is_grad_enabled():
            return super().forward(x)
        return _InputGradConv2d.apply(x, self.weight, self.bias, self)

    def weight_grad(self, x, dy):
        return torch.nn.grad.conv2d_weight(x, self.weight.shape, dy, self.stride, self.padding, self.dilation,
                                           self.groups)


SPLIT = {nn.Linear: SplitLinear, nn.Conv2d: SplitConv2d}


class WeightGradStash:
    """What W needs, per microbatch: (layer, input, output gradient) of every split layer of one
    chunk, detached (so no autograd graph outlives its B), from B until that microbatch's W."""

    def __init__(self, chunk):
        self.layers = [m for m in chunk.modules() if type(m) in SPLIT]
        for layer in self.layers:                 # same object, same parameters: only forward changes
            layer.__class__, layer.stash = SPLIT[type(layer)], self
        self.pending = {}                         # microbatch -> [(layer, x, dy)], in backward order
        self.microbatch = None                    # the microbatch whose B is running
        self.active = False                       # off: the layers are plain Linear and Conv2d

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

    @torch.no_grad()
    def weight_grads(self, mb):
        """W: dA of every split layer for microbatch mb, added to A.grad as autograd accumulates."""
        for layer, x, dy in self.pending.pop(mb, []):
            grad = layer.weight_grad(x, dy)
            if layer.weight.grad is None:
                layer.weight.grad = grad
            else:
                layer.weight.grad += grad
