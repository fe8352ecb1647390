"""Tensor parallelism: every rank holds a slice of every weight and computes a subset of the neurons.

The lesson (Krizhevsky et al. 2012, AlexNet on two GPUs; Shoeybi et al. 2019, Megatron-LM): split a Linear
by output features (column-parallel), feed its split output straight into a Linear split by input
features (row-parallel), and the pair needs one all-reduce in forward and one in backward. The
degree is the world size; every rank sees the whole global batch and logs the baseline's losses.

What this adds to single_baseline.py, in order: the conjugate operators (autograd functions around
one collective of mp/tp/collectives.py), the sharded layers (ColumnParallelLinear, RowParallelLinear
and their conv and attention kin), parallelize(), which slices the baseline's model into them block
by block, and train_step: the baseline's, with the replicated gradients synchronised before the norm.

    torchrun --standalone --nproc-per-node 2 tensor_parallel.py --data synthetic --model cnn
    torchrun --standalone --nproc-per-node 2 tensor_parallel.py --data synthetic --check

The weight split of one column + row pair on 2 ranks (X: batch x in, whole on every rank):

    Y = X A,   A = [A1 | A2]          column-parallel: rank i computes Y_i = X A_i (its neurons)
                                      f = copy_to_tp_region before it: forward identity,
                                          backward all-reduce of dL/dX
            [B1]
    Z = Y B,   B = [--]               row-parallel: rank i computes Y_i B_i, a partial sum;
            [B2]                      g = reduce_from_tp_region after it: forward all-reduce,
                                          backward identity
    Z = Y1 B1 + Y2 B2                 the bias of B is added once, after the sum

    rank 0:  X --f--> X A1 = Y1 --GELU--> Y1 B1 --+
                                                  g (all-reduce) --> Z, whole on every rank
    rank 1:  X --f--> X A2 = Y2 --GELU--> Y2 B2 --+

GELU is elementwise, so it runs on each shard with no communication. A layer that ends a model
without a row-parallel partner is column-parallel with gather_from_tp_region (forward all-gather,
backward split), so that the logits are whole on every rank.

--sequence-parallel (the vit; Korthikanti et al. 2022) splits g's all-reduce into its two halves: a
reduce-scatter after the row-parallel layer, so that LayerNorm, dropout and the residual add run
on 1/t of the tokens, and an all-gather before the next column-parallel layer. The same bytes,
those activations t times smaller; f, g and the layers are here, the rest in mp/tp/sequence.py.
--model gpt splits its vocabulary (Megatron's VocabParallelEmbedding and vocab_parallel_cross_entropy): each
rank holds V/T rows of the embedding and of the output layer (tied: the same Parameter) and computes the logits
of its V/T bytes only; the loss reduces the max, the sum of exponentials and the target's logit over the group,
never the [b, s, V] logits (mp/tp/vocab.py, parallel_gpt_block below).
--hybrid (data-parallel convolutions, a tensor-parallel classifier) is mp/tp/hybrid.py; --check is
mp/check.py, the replicated parameters mp/replicas.py.

    torchrun --standalone --nproc-per-node 2 tensor_parallel.py --data synthetic --model vit --sequence-parallel
    torchrun --standalone --nproc-per-node 2 tensor_parallel.py --data synthetic --model gpt --tie-embeddings
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mp import checkpoint
from mp.check import check_and_exit, whole_model_step
from mp.cli import tensor_parallel_args
from mp.clipping import clip_global
from mp.data import agree_on_data, load_data, to_device
from mp.dist import distributed, exit_now, group_timeout
from mp.dropout import KeyedDropout
from mp.errors import note_one_rank
from mp.loss import loss_function
from mp.loop import Job, Replicas, Sums, evaluate, train, whole_model_run
from mp.mesh import Mesh
from mp.models import Attention, build_model, num_blocks
from mp.moe import MixtureOfExperts
from mp.optim import make_optimizer
from mp.sizes import VIT_TOKENS, split_sizes, tokens_of
from mp.tp.collectives import all_reduce, tp_rank, tp_size
from mp.tp.hybrid import HybridCNN
from mp.tp.mappings import (gather_from_sequence_parallel_region, gather_from_tp_region,
                            reduce_scatter_to_sequence_parallel_region)
from mp.replicas import average_replicated_grads, counted_once, replicated_parameters
from mp.tp.sequence import shard_sequence, sum_sequence_parallel_grads
from mp.tp.vocab import VocabParallelEmbed, VocabParallelHead, tp_loss_function, vocab_parallel_scores

PROGRAM = "tensor_parallel"


def parse_args(argv=None):
    args = tensor_parallel_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    checkpoint.validate(args)               # the checkpoint to resume from, if any: whole, and of this run
    return args


# ----------------------------------------------------------------------------- the conjugate operators
# each wraps one collective of mp/tp/collectives.py; forward and backward are each other's conjugate


class _CopyToTP(torch.autograd.Function):
    """f: forward identity (each rank has the whole input); backward all-reduce (sum the shards' input gradients)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # summed in place, no copy: f feeds only column-parallel layers (and attention's q, k, v), so grad
        # is the input gradient they just computed, a fresh product (or autograd's fresh sum of three)
        # that nothing else holds; a residual's shared gradient reaches f's input, never its output
        return all_reduce(grad, ctx.group, in_place=True), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce (sum the partial outputs); backward identity (the sum's gradient is whole everywhere)."""

    @staticmethod
    def forward(ctx, x, group):
        if tp_size(group) == 1 or not x.is_contiguous():
            return all_reduce(x, group)
        # x is a fresh layer output that autograd does not save (linear and conv keep their input),
        # so it is summed in place rather than copied first; mark_dirty tells autograd so
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp_region(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x, group):
    return _ReduceFromTP.apply(x, group)


# ----------------------------------------------------------------------------- parallel layers


class _Sharded(nn.Module):
    """A layer made from the full one by slicing its parameters, so it starts identical to the baseline.
    `shards` maps a parameter name to (dim, start, length) in the full parameter; absent = replicated."""

    def __init__(self, full, group, dim, sizes):
        super().__init__()
        if isinstance(full, nn.Conv2d):
            if full.groups != 1 or full.padding_mode != "zeros":
                raise ValueError("only plain convolutions (groups=1, zero padding) are split here")
            self.op, self.feature_dim = partial(F.conv2d, stride=full.stride, padding=full.padding,
                                                dilation=full.dilation), 1
        else:
            self.op, self.feature_dim = F.linear, -1
        self.group = group
        self.sizes = sizes or split_sizes(full.weight.shape[dim], tp_size(group))
        start, length = sum(self.sizes[:tp_rank(group)]), self.sizes[tp_rank(group)]
        self.shards = {"weight": (dim, start, length)}
        self.weight = nn.Parameter(full.weight.detach().narrow(dim, start, length).clone())
        if full.bias is not None and dim == 0:  # output-split layers split the bias too
            self.shards["bias"] = (0, start, length)
            self.bias = nn.Parameter(full.bias.detach().narrow(0, start, length).clone())
        else:
            self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())


class _ColumnParallel(_Sharded):
    def __init__(self, full, group, sizes=None, copy_input=True, gather_output=False, sequence_parallel=False):
        super().__init__(full, group, 0, sizes)
        self.copy_input, self.gather_output, self.sequence_parallel = copy_input, gather_output, sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:   # the input is my tokens: gather them all (in place of f)
            x = gather_from_sequence_parallel_region(x, self.group)
        elif self.copy_input:
            x = copy_to_tp_region(x, self.group)
        y = self.op(x, self.weight, self.bias)
        return gather_from_tp_region(y, self.group, self.sizes, self.feature_dim) if self.gather_output else y


class _RowParallel(_Sharded):
    def __init__(self, full, group, sizes=None, sequence_parallel=False):
        super().__init__(full, group, 1, sizes)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel and self.bias is not None:   # added to my tokens only: a partial gradient
            self.bias.sequence_parallel = True

    def forward(self, x):
        reduce = reduce_scatter_to_sequence_parallel_region if self.sequence_parallel else reduce_from_tp_region
        y = reduce(self.op(x, self.weight), self.group)
        if self.bias is None:
            return y
        # replicated bias, added once after the sum (added on every rank before it, it would count degree times)
        return y + (self.bias.view(-1, 1, 1) if self.feature_dim == 1 else self.bias)


class ColumnParallelLinear(_ColumnParallel):
    """nn.Linear with its output features split: Y_i = X A_i (weight rows and bias sliced)."""


class ColumnParallelConv2d(_ColumnParallel):
    """nn.Conv2d with its output channels split (weight rows and bias sliced); gathers along channels."""


class RowParallelLinear(_RowParallel):
    """nn.Linear with its input features split: the partial sums X_i B_i are all-reduced; bias replicated."""


class RowParallelConv2d(_RowParallel):
    """nn.Conv2d with its input channels split: the partial sums are all-reduced; bias replicated."""


class ParallelAttention(Attention):
    """mp.models.Attention on this rank's whole heads: q, k, v column-parallel, proj row-parallel.
    Attention reads the head count off its weights, so its forward runs unchanged on the local heads."""

    def __init__(self, full, group, sizes, sequence_parallel=False):
        nn.Module.__init__(self)  # not Attention.__init__: the layers are slices of `full`
        self.group, self.head_dim, self.sequence_parallel = group, full.head_dim, sequence_parallel
        self.causal = full.causal   # the gpt's mask: my heads' scores are masked as the full layer's
        self.q, self.k, self.v = (ColumnParallelLinear(f, group, sizes, copy_input=False)
                                  for f in (full.q, full.k, full.v))
        self.proj = RowParallelLinear(full.proj, group, sizes, sequence_parallel=sequence_parallel)

    def forward(self, x):
        # enter the region once for q, k and v: backward all-reduces (or reduce-scatters) their summed
        # input gradient once, not 3x
        enter = gather_from_sequence_parallel_region if self.sequence_parallel else copy_to_tp_region
        return super().forward(enter(x, self.group))


# ----------------------------------------------------------------------------- parallelize: the models made parallel


def parallel_cnn_block(i, block, group):
    """conv1 | conv2 and fc1 | fc2 are column | row pairs; fc3 is column-parallel with a gather.
    GroupNorm sits after conv2's all-reduce, on all 16 whole channels: replicated, no communication."""
    if i == 0:
        block[0] = ColumnParallelConv2d(block[0], group)  # GELU and avg-pool are per channel: no comm
    elif i == 1:
        block[0] = RowParallelConv2d(block[0], group)
    return parallel_cnn_classifier_block(i, block, group)


def parallel_cnn_classifier_block(i, block, group):
    """fc1 | fc2 a column | row pair, fc3 column-parallel with a gather (the logits whole on every rank)."""
    if i == 2:
        block[1] = shard_dropout(block, ColumnParallelLinear(block[1], group))
    elif i == 3:
        block[0] = RowParallelLinear(block[0], group)
    elif i == 4:
        block[0] = ColumnParallelLinear(block[0], group, gather_output=True)
    return block


def parallel_mlp_block(i, block, group, n_blocks):
    """Linear layers (one a block) paired from the front as column | row; with an odd count the
    classifier is left over and becomes column-parallel with a gather, so every weight matrix stays sharded."""
    j = next(j for j, m in enumerate(block) if isinstance(m, nn.Linear))
    block[j] = RowParallelLinear(block[j], group) if i % 2 else \
        shard_dropout(block, ColumnParallelLinear(block[j], group, gather_output=i == n_blocks - 1))
    return block


def shard_dropout(block, column):
    """A dropout after a column-parallel layer sees only this rank's output features, start.. of
    the full layer's: it must draw those elements' masks, not the first ones' (mp/dropout.py)."""
    _, start, _ = column.shards["weight"]
    for m in block:
        if isinstance(m, KeyedDropout) and not column.gather_output:
            m.shard = (start, sum(column.sizes))
    return column


def parallel_vit_block(i, block, group, n_blocks, sequence_parallel=False, tokens=VIT_TOKENS):
    """Attention split by heads, the block MLP column | row; LayerNorms, the patch embedding and the
    head are replicated (small, and the residual stream must be whole for LayerNorm anyway).
    sequence_parallel: the residual stream, and so the LayerNorms and dropouts, on my `tokens` // T only."""
    if 0 < i < n_blocks - 1:
        heads = block.attn.q.out_features // block.attn.head_dim
        head_sizes = [n * block.attn.head_dim for n in split_sizes(heads, tp_size(group))]
        block.attn = ParallelAttention(block.attn, group, head_sizes, sequence_parallel)
        if not isinstance(block.mlp, MixtureOfExperts):   # experts stay whole: ep, not tp, spreads them (parallel_5d.py)
            block.mlp[0] = ColumnParallelLinear(block.mlp[0], group, sequence_parallel=sequence_parallel)
            block.mlp[2] = RowParallelLinear(block.mlp[2], group, sequence_parallel=sequence_parallel)
    if sequence_parallel:   # the embedding, the head, the norms and dropouts on my tokens (mp.tp.sequence)
        block = shard_sequence(i, block, group, n_blocks, reduce_from_tp_region, tokens)
    return block


def parallel_gpt_block(i, block, group, n_blocks, sequence_parallel=False, tokens=None):
    """The gpt: its causal transformer blocks split as the vit's; its embedding and head split by rows of the
    vocabulary (mp.tp.vocab), so that a rank computes the logits of its V/T bytes only, [b, s, V/T]. The
    embedding's partial lookups are summed by g (sequence parallel: reduce-scattered to my tokens); the
    head's input enters through f (sequence parallel: the tokens all-gathered)."""
    if i == 0:
        return VocabParallelEmbed(block, group, reduce_from_tp_region, sequence_parallel)
    if i == n_blocks - 1:
        enter = gather_from_sequence_parallel_region if sequence_parallel else copy_to_tp_region
        return VocabParallelHead(block, group, enter, sequence_parallel)
    return parallel_vit_block(i, block, group, n_blocks, sequence_parallel, tokens)


def parallelize_block(i, block, model_name, group, n_blocks, hybrid=False, sequence_parallel=False,
                      tokens=VIT_TOKENS):
    """Block i of the full model with its layers replaced, in place, by this rank's parallel layers
    (same names); the full weights go as soon as the caller drops the full block. tokens: a sample's
    (sequence parallelism's split), the vit's 64 or the gpt's --seq-len."""
    if hybrid:   # the convolutions stay whole (data-parallel), the classifier is split
        return parallel_cnn_classifier_block(i, block, group)
    if model_name == "cnn":
        return parallel_cnn_block(i, block, group)
    if model_name == "vit":
        return parallel_vit_block(i, block, group, n_blocks, sequence_parallel)
    if model_name == "gpt":
        return parallel_gpt_block(i, block, group, n_blocks, sequence_parallel, tokens)
    return parallel_mlp_block(i, block, group, n_blocks)


def build_parallel_model(args, group, device, hybrid=False):
    """This rank's model and nothing more (the memory contract): block by block from --seed, each
    full block sliced into my shards as soon as it is built, the full one dropped before the next."""
    sequence_parallel = getattr(args, "sequence_parallel", False)
    shard = partial(parallelize_block, model_name=args.model, group=group, n_blocks=num_blocks(args), hybrid=hybrid,
                    sequence_parallel=sequence_parallel, tokens=tokens_of(args))
    return summed_where_partial(build_model(args, shard, device), group, hybrid)


def parallelize(model, model_name, group, hybrid=False, sequence_parallel=False, tokens=VIT_TOKENS):
    """A whole model (tests and benchmarks build one) made parallel block by block, in place."""
    for i, block in enumerate(model):
        model[i] = parallelize_block(i, block, model_name, group, len(model), hybrid, sequence_parallel, tokens)
    return summed_where_partial(model, group, hybrid)


def summed_where_partial(model, group, hybrid):
    """Replicated parameters applied to a part of the data on each rank get partial gradients, which the
    step sums over the group after its backward (model.partial_grads, a SummedGradients, or None):
    --hybrid's convolutions (mp.tp.hybrid), sequence-parallel norms (mp.tp.sequence)."""
    if hybrid:
        return HybridCNN(model, group)
    model.partial_grads = sum_sequence_parallel_grads(model, group)
    return model


# ----------------------------------------------------------------------------- training


def sync_tp_grads(partial_sums, replicated):
    """Tensor parallelism's gradient synchronisation, once a step after the last backward: the
    replicated parameters that each rank applied to its part of the data only (--hybrid's
    convolutions, --sequence-parallel's norms) get their partial gradients summed; on a GPU the other
    replicated gradients are averaged, so that last-bit differences cannot grow (mp.replicas).
    Each is None where there is nothing to do (on the CPU the replicated gradients are identical)."""
    if partial_sums:
        partial_sums.sum()
    if replicated:
        replicated.average()


def train_step(step, model, optimizer, data, args, device, tp_grads, norm, group):
    """One optimizer step of single_baseline.py's, on this rank's shards: the same order, the
    collectives inside the layers, and the replicated parameters' gradients synchronised before the
    norm. The logits are whole on every rank (the gpt: my vocabulary columns, whose loss reduces the
    whole vocabulary's max, sum and target over the group), so each computes the loss; tp rank 0 logs it."""
    x, y = (to_device(t, device) for t in data.batch(step, args.batch_size))   # the whole batch, on every rank
    optimizer.zero_grad(set_to_none=True)
    loss_fn = tp_loss_function(args, data, step, group)   # the image models' mean; the gpt's, mp/tp/vocab.py
    with model.dropout_keys.training(step):
        loss = loss_fn(model(x), y)   # f, g and the gathers run inside the parallel layers
    loss.backward()
    sync_tp_grads(*tp_grads)
    grad_norm = clip_global(model.parameters(), args.clip_grad_norm, *norm)   # the full model's norm
    optimizer.step()
    return loss.detach(), grad_norm   # tensors: the loop reads them every --log-every steps


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("tensor parallelism of degree 1, every weight whole")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        # the one mesh (mp/mesh.py) with every rank on its tp axis: the layers' collectives run on its tp group
        mesh = Mesh.build(env.rank, env.world_size, tp=env.world_size, timeout=group_timeout(env, args.timeout_s))
        group = mesh.tp_group
        model = build_parallel_model(args, group, env.device, args.hybrid)
        # partial gradients to sum (--hybrid, --sequence-parallel), and on a GPU the replicated ones to average
        tp_grads = (model.partial_grads, average_replicated_grads(model, group, env.device))
        # the gradient norm sums the shards' squares over the group, each replicated tensor counted once
        norm = ([group], counted_once(model, group))
        if args.check:
            x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
            what = f"tensor parallelism{' --hybrid' if args.hybrid else ''}"
            return check_and_exit(env, args, what, model, check_step(args, data, model, tp_grads, group), x, y,
                                  norm=norm, loss_fn=loss_function(args, data, 0))
        optimizer = make_optimizer(model.parameters(), args)

        def step(k):
            return train_step(k, model, optimizer, data, args, env.device, tp_grads, norm, group)

        # the loop (mp/loop.py) runs the steps, logs (tp rank 0 owns the loss), evaluates, saves, and at the
        # end checks that the weights every rank holds whole stayed bit-identical
        layout = checkpoint.layout_of(PROGRAM, env, tp=env.world_size, hybrid=args.hybrid)
        replicas = Replicas(replicated_parameters(model), group, "replicated parameters bit-identical across the "
                            f"{env.world_size} tensor-parallel ranks")
        return train(args, env, Job(step, model, optimizer, layout, owner=env.rank == 0, sums=Sums(norm_groups=[group]),
                                    evaluate=lambda: evaluate(data, env.device, whole_model_run(model, env.device),
                                                              scores=vocab_parallel_scores(args, group)),
                                    collectives="the tensor-parallel collectives", replicas=[replicas]))


def check_step(args, data, model, tp_grads, group):
    """--check's step (mp.check): forward and backward on the first batch, then the gradients synchronised.
    The gpt's logits are my vocabulary columns: gathered here, for --check's comparison only."""
    def step(x, y):
        logits, loss = whole_model_step(model, tp_loss_function(args, data, 0, group))(x, y)
        sync_tp_grads(*tp_grads)
        if args.model == "gpt":
            logits = gather_from_tp_region(logits.detach(), group, [logits.shape[-1]] * tp_size(group))
        return logits, loss
    return step


if __name__ == "__main__":
    exit_now(main())  # everything is written and torn down: skip gloo's destructors (mp.dist.exit_now)
