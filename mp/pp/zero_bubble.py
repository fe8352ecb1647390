"""The backward split in two for zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism"): B, the gradient of a stage's input, which the stage before waits for, and W, the
gradient of its weights, which nobody waits for and which schedules.py's zb therefore moves into
the pipeline's idle ticks.

For y = x A^T + b (a Linear), the backward is two products with the output's gradient dy:

    B: dx = dy A          needed upstream now         (and db = sum of dy: tiny, taken here too)
    W: dA = dy^T x        needed only by the optimizer step, so it can wait

split_weight_grads(chunk) gives each weight-bearing op of a chunk that backward: a plain
nn.Linear or nn.Conv2d is replaced by its split twin, a module holding the very same parameter
objects (same names, same optimizer state, same checkpoint keys); a tensor-parallel shard
(tensor_parallel.py's sharded layers, which compute op(x, weight slice, bias)) keeps its module and
gets a split op. Either way the backward returns dx and db at once and leaves (x, dy) in the
chunk's WeightGradStash; the collectives around a shard (f, g, all-gathers) are autograd functions
of their own and stay in B. The W action of that microbatch adds dA to A.grad: in place, as one
GEMM into A.grad (A.grad += dy^T x with no temporary: cheaper than the unsplit backward's product
then add, docs/benchmarks.md), or, for a weight with gradient hooks, through autograd, which fires
them as an unsplit backward would. Other parameters (norms, embeddings, a row-parallel layer's
bias added after its all-reduce) take their gradients in B.

    stash = split_weight_grads(chunk)    # once: the chunk's Linear, Conv2d and shard ops now split
    with stash.backward_of(mb):          # B: autograd.backward through the chunk
        torch.autograd.backward(y, dy)
    stash.weight_grads(mb)               # W: later, A.grad += dA for every split layer

The other schedules split their large linear layers too (split_for: "B"; FUSED_MIN_WEIGHT). The
schedule does not change; two things do. The arithmetic: one GEMM into A.grad in place of autograd's
product and then its add, what Megatron-LM's gradient-accumulation fusion does on a GPU. And the
wait: the stage before needs B's dx, not W, so the executor runs a B's W in the next exchange, once
dx is sent and before it waits for its own next message (run_weight_grads, the exchange's
meanwhile); the buckets hear that a chunk's gradients are final there too, after its last Ws.
Small layers and convolutions keep autograd's backward, which costs them less. Measured on 2 stages
and 2 cores (benchmarks/zero_bubble.py --paired-fused, docs/results.md): B and W of a microbatch
8.0-8.7 ms against autograd's 10.2-10.3 ms, 1F1B's step 0.94 and GPipe's 0.92 of theirs with
autograd's weight gradients; with W after the send, 1F1B's step 0.956-0.972 of its W inside its B
(GPipe's 0.99-1.01). 2bw keeps autograd: its forwards run one of two weight versions in place of the
layer's parameters (torch.func.functional_call), and a W would write into the layer's own.
"""
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F


class LinearMath:
    """y = x A^T + b and its three gradients."""

    def op(self, x, weight, bias=None):
        return F.linear(x, weight, bias)

    def input_grad(self, shape, weight, dy):
        return dy @ weight

    def bias_grad(self, dy):
        return dy.reshape(-1, dy.shape[-1]).sum(0)

    def weight_grad(self, x, dy, weight_shape):
        return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

    def add_weight_grad(self, grad, x, dy):
        """grad += dy^T x as one GEMM writing into grad (beta = 1): no (out x in) temporary to allocate,
        fill and add, which is what autograd's accumulation costs on top of the product."""
        grad.addmm_(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


class ConvMath:
    """y = conv2d(x, A) + b with its geometry (stride, padding, dilation, groups), and its gradients."""

    def __init__(self, **geometry):
        self.geometry = geometry

    def op(self, x, weight, bias=None):
        return F.conv2d(x, weight, bias, **self.geometry)

    def input_grad(self, shape, weight, dy):
        return torch.nn.grad.conv2d_input(shape, weight, dy, **self.geometry)

    def bias_grad(self, dy):
        return dy.sum((0, 2, 3))

    def weight_grad(self, x, dy, weight_shape):
        return torch.nn.grad.conv2d_weight(x, weight_shape, dy, **self.geometry)

    def add_weight_grad(self, grad, x, dy):
        grad += self.weight_grad(x, dy, grad.shape)


class _InputGradOnly(torch.autograd.Function):
    """forward: the layer's op. backward: dx (if anything reads it) and db now; (x, dy) to the
    stash; the weight (given detached) gets nothing until W."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, anchor):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return layer.math.op(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        layer.stash.put(layer, x, dy)
        # the first stage's first layer reads the images, which need no gradient: skip its product
        dx = layer.math.input_grad(x.shape, weight, dy) if ctx.needs_input_grad[0] else None
        db = layer.math.bias_grad(dy) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db, None, None


def split_op(layer, x, weight, bias=None):
    """The split forward: the weight goes in detached, so B has no edge to it at all; autograd
    neither touches A.grad nor fires A's hooks with an empty gradient. W is the one that reaches A.
    A frozen weight (requires_grad False) is not split: autograd gives it nothing, as unsplit. When
    nothing else needs a gradient (a bias-free first layer, whose input is the images), the anchor,
    an empty tensor that asks for one, keeps the op in the graph, so that B still stashes (x, dy)."""
    if not torch.is_grad_enabled() or not weight.requires_grad:   # evaluation, --recompute's first F, frozen
        return layer.math.op(x, weight, bias)
    return _InputGradOnly.apply(x, weight.detach(), bias, layer, ANCHOR)


ANCHOR = torch.empty(0, requires_grad=True)   # see split_op; it never gets a gradient


class _DeferredWeightGrad(torch.autograd.Function):
    """forward: a zero, tied to the weight. backward: dA from B's (x, dy). Running autograd on it
    in W makes autograd itself accumulate dA into A.grad and fire A's hooks (data parallelism's)."""

    @staticmethod
    def forward(ctx, weight, x, dy, layer):
        ctx.save_for_backward(x, dy)
        ctx.layer, ctx.shape = layer, weight.shape
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        x, dy = ctx.saved_tensors
        return ctx.layer.math.weight_grad(x, dy, ctx.shape), None, None, None


class SplitLinear(nn.Module):
    """Takes an nn.Linear's place, with its parameters; its backward defers dA to W."""

    def __init__(self, layer, stash, math=None):
        super().__init__()
        self.register_parameter("weight", layer.weight)
        self.register_parameter("bias", layer.bias)
        self.stash, self.math = stash, math or LinearMath()

    def forward(self, x):
        return split_op(self, x, self.weight, self.bias)


class SplitConv2d(SplitLinear):
    """Takes an nn.Conv2d's place, with its parameters and geometry; its backward defers dA to W."""

    def __init__(self, layer, stash):
        if layer.padding_mode != "zeros":
            raise ValueError("the split convolution pads with zeros only")
        super().__init__(layer, stash, ConvMath(stride=layer.stride, padding=layer.padding,
                                                dilation=layer.dilation, groups=layer.groups))


class SplitShardOp:
    """A tensor-parallel shard's op, split: the shard calls it as op(x, weight, bias) and it runs
    F.linear or its conv2d (tensor_parallel._Sharded.op, a partial holding the geometry) with the
    split backward; W's dA lands in the shard's own weight slice."""

    def __init__(self, shard, stash):
        self.shard, self.stash = shard, stash
        geometry = shard.op.keywords if isinstance(shard.op, partial) else None
        self.math = LinearMath() if geometry is None else ConvMath(**geometry)

    @property
    def weight(self):
        return self.shard.weight

    def __call__(self, x, weight, bias=None):
        return split_op(self, x, weight, bias)


SPLIT = {nn.Linear: SplitLinear, nn.Conv2d: SplitConv2d}


def split_for(schedule, zero=0):
    """Where a schedule's weight gradients are taken (pipeline_microbatch.StageRunner's split): "W", in
    W actions of their own (zb, zbv); None, by autograd in B (2bw, whose two weight versions share the
    layers; and --zero 2 and 3, which reduce-scatter each layer's gradient bucket as soon as the
    microbatch's backward has filled it: a W after the whole B would keep every bucket of the chunk
    alive from its bias's gradient to its weight's); "B", every other schedule: its large linear layers
    split too (split_weight_grads's fused), each W run in the exchange after its B (run_weight_grads)."""
    if schedule in ("zb", "zbv"):
        return "W"
    return None if schedule == "2bw" or zero >= 2 else "B"


def split_weight_grads(chunk, fused=False):
    """Split every plain nn.Linear and nn.Conv2d in chunk (replaced by its twin) and every
    tensor-parallel shard (its op replaced); return their stash. fused (split "B", W after B's send):
    only the linear ones of FUSED_MIN_WEIGHT elements or more, where the in-place GEMM gains."""
    stash = WeightGradStash()
    for parent in list(chunk.modules()):
        if hasattr(parent, "shards") and callable(getattr(parent, "op", None)):   # a tensor-parallel shard
            if not fused or worth_fusing(parent, not isinstance(parent.op, partial)):   # partial: a conv2d
                parent.op = SplitShardOp(parent, stash)
                stash.weights += [parent.weight] if parent.weight.requires_grad else []
        for name, child in list(parent.named_children()):
            if type(child) in SPLIT and (not fused or worth_fusing(child, type(child) is nn.Linear)):   # not shards
                twin = SPLIT[type(child)](child, stash)
                keep_module_hooks(child, twin)
                setattr(parent, name, twin)
                stash.weights += [child.weight] if child.weight.requires_grad else []
    return stash


# split "B" gains only on a linear layer this large (elements of its weight): forward and backward of 32 rows
# through one layer, W in place against autograd's, on one core (2026-11-26): 84 x 120 1.27, 120 x 400 1.10,
# 256 x 256 1.04, 512 x 256 0.91, 512 x 512 0.93, 768 x 768 0.87. The split's autograd Function and
# stash cost some 20 us a layer in Python; the temporary it saves costs less than that below ~100k elements.
# Convolutions are never fused: conv2d_input and conv2d_weight apart cost more than autograd's one call.
FUSED_MIN_WEIGHT = 100_000


def worth_fusing(layer, linear):
    return linear and layer.weight.numel() >= FUSED_MIN_WEIGHT


def keep_module_hooks(old, new):
    """The hooks registered on the replaced module (forward, pre-forward, backward) run on its twin:
    the twin takes over the very dictionaries that hold them."""
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    new._is_full_backward_hook = getattr(old, "_is_full_backward_hook", None)


class WeightGradStash:
    """What W needs, per microbatch: (layer, input, output gradient) of every split layer of one
    chunk, detached (so no autograd graph outlives its B), from B until that microbatch's W."""

    def __init__(self):
        self.pending = {}                         # microbatch -> [(layer, x, dy)], in backward order
        self.microbatch = None                    # the microbatch whose B is running
        self.weights = []                         # the split layers' weights: W, not B, gives their gradients
        self.at_once, self.buckets = False, None  # backward_of(at_once=True): each W inside its B (below)

    def put(self, layer, x, dy):
        assert self.microbatch is not None, "a split layer's backward ran outside a B action"
        if self.at_once and not has_grad_hooks(layer.weight):
            # nobody waits for this B's input gradient, so nothing gains by W waiting: the layer's W now,
            # the same GEMM into the same .grad, rather than every split layer's input and output gradient
            # stashed until the B's end (autograd lets each go as soon as its layer's backward is done)
            self.write_weight_grad(layer, x, dy, self.buckets)
            return
        self.pending.setdefault(self.microbatch, []).append((layer, x.detach(), dy.detach()))

    @contextmanager
    def backward_of(self, mb, at_once=False, buckets=None):
        """B of microbatch mb runs inside. at_once (split "B" on a stage alone, where no exchange follows B
        and no stage before waits for its dx): each W runs inside the B, told to buckets as weight_grads
        tells them; its weight's gradient gets the very GEMM it would have got just after the B."""
        self.microbatch, self.at_once, self.buckets = mb, at_once, buckets
        try:
            yield
        finally:
            self.microbatch, self.at_once, self.buckets = None, False, None

    def weight_grads(self, mb, buckets=None):
        """W: dA of every split layer for microbatch mb, added to A.grad. A weight that has gradient
        hooks (data parallelism's, a replica's average) takes dA through autograd, which fires them;
        any other weight takes it directly: A.grad set, or dA added in place by one GEMM (what
        autograd's accumulation does, less its temporary and its autograd function per layer).
        buckets: data parallelism's (mp.buckets), told of each gradient written directly, before and after
        (no hook runs on those weights, so W says it: GradBuckets.arriving and arrived)."""
        hooked = []
        for layer, x, dy in self.pending.pop(mb, []):
            weight = layer.weight
            if not weight.requires_grad:          # frozen since the forward: no gradient, as autograd's
                continue
            if has_grad_hooks(weight):
                hooked.append(_DeferredWeightGrad.apply(weight, x, dy, layer))
                continue
            self.write_weight_grad(layer, x, dy, buckets)
        if hooked:
            torch.autograd.backward(hooked)

    @staticmethod
    def write_weight_grad(layer, x, dy, buckets=None):
        """dA into A.grad directly (a weight without gradient hooks): set, or added in place by one GEMM."""
        weight = layer.weight
        if not weight.requires_grad:              # frozen since the forward: no gradient, as autograd's
            return
        if buckets is not None:
            buckets.arriving(weight)              # --zero 2, 3: its bucket's memory, made for this microbatch
        if weight.grad is None:                   # the step's first W (the optimizer set grads to None)
            weight.grad = layer.math.weight_grad(x, dy, weight.shape)
        else:
            layer.math.add_weight_grad(weight.grad, x, dy)
        if buckets is not None:
            buckets.arrived(weight)


def run_weight_grads(runner, grads=None):
    """split "B" (runner.fused): every W whose B has run and whose W has not, oldest first, each on
    runner's timeline; the next exchange runs them once their Bs' input gradients are sent (the stage
    before waits for those, not for W). Then grads (data parallelism's buckets) is told that every
    gradient it expects (a chunk's last B has run, GradBuckets.expect) is final. True if a W ran. Under
    split "W" (zb, zbv) no W runs here: theirs wait for W actions of their own."""
    ran = False
    for chunk, stash in enumerate(runner.stashes if runner.fused else ()):
        for mb in list(stash.pending):
            start = runner.clock()
            stash.weight_grads(mb, grads)
            runner.record("weight", f"W{mb}", mb, start, chunk)
            ran = True
    if grads is not None:
        grads.final_expected()
    return ran


def bucket_plan(actions, final_after, fused):
    """What the executor tells the data-parallel buckets (mp.buckets) in one step: ({the index of each
    chunk's last B (zb: last W): the parameters whose gradients it makes final}, {the indices after
    which run_weight_grads runs at once}). Split "B": the Bs that no exchange follows before the rank's
    next B (a stage alone: no exchange at all), so every B's Ws have run before the next B starts: the
    gradients that arrive once a chunk's last B begins are that B's (GradBuckets.expect), and under
    --zero 2 and 3 each microbatch's are complete, to be reduce-scattered, before the next one's begin.
    Otherwise each chunk's last B (W): nothing runs in W, its gradients are told final at once."""
    last = {(a[0], a[2]): i for i, a in enumerate(actions) if a[0] in ("B", "W")}
    closing = {i: final_after[key] for key, i in last.items()}
    if not fused:
        return closing, set(closing)
    now, previous = set(), None
    for i, action in enumerate(actions):
        if action[0] == "comm":
            previous = None
        elif action[0] == "B":
            if previous is not None:
                now.add(previous)
            previous = i
    return closing, now


def final_after(chunks, stashes, split):
    """{(kind, chunk): the parameters whose gradients are final once the chunk's last action of that
    kind in a step has run}: its last B, but under split "W" the split weights wait for its last W."""
    deferred = {id(w) for stash in stashes or [] for w in stash.weights} if split == "W" else ()
    final = {("B", c): [p for p in chunk.parameters() if id(p) not in deferred] for c, chunk in enumerate(chunks)}
    final.update({("W", c): stash.weights for c, stash in enumerate(stashes or [])})
    return final


def has_grad_hooks(weight):
    """Hooks that autograd would run on weight's gradient: Tensor.register_hook (before the
    accumulation) or register_post_accumulate_grad_hook (after). Only autograd runs them."""
    return bool(weight._backward_hooks) or bool(weight._post_accumulate_grad_hooks)
