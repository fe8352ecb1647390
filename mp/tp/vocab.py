"""tensor_parallel.py --model gpt: the vocabulary split over the tensor-parallel ranks (Shoeybi et al.
2019, Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy), so that no rank ever holds
the [b, s, V] logits, the largest activation of a language model (V = 256 bytes here; 128,000 in Llama 3).

Rank r of T holds rows [r V/T, (r+1) V/T) of the embedding (and of the head's weight: tied, the same
Parameter):

    embedding   tokens --look up my rows (zeros for a token outside them)--> partial [b, s, H]
                --g: all-reduce (sequence parallel: reduce-scatter)--> the embedding, + pos
    head        x --f (sequence parallel: all-gather the tokens)--> LN(x) @ W_r.T = my logits [b, s, V/T]
    loss        m = max over V          all-reduce MAX of my columns' max
                Z = sum over V exp(l-m) all-reduce SUM of my columns' sum       } one all-reduce,
                l_t - m, t the target   all-reduce SUM, from the rank owning t  } stacked
                loss = log Z - (l_t - m);  backward on my columns: softmax - one-hot(t), x the upstream gradient

Every token sum a rank computes is the whole vocabulary's, so each rank holds the loss the baseline logs; it is
scaled as mp.loss.loss_function scales it (the token sum x pieces / the global batch's valid tokens; the tp ranks
hold the same tokens: one piece). The evaluation reuses the same path (vocab_parallel_scores): the loss's sum, and
the argmax as a max and a smallest index reduced over tp.
"""
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mp.loss import loss_function, sum_in_float64
from mp.text import IGNORE
from mp.tp.collectives import all_reduce, tp_rank, tp_size
from mp.tp.mappings import reduce_scatter_to_sequence_parallel_region
from mp.tp.sequence import partial_gradients


def my_vocab(vocab, group):
    """(start, length): the rows of a vocabulary of `vocab` that this rank holds (mp.tp.flags: T divides it)."""
    length = vocab // tp_size(group)
    return tp_rank(group) * length, length


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows split: my V/T rows; a token outside them looks up zeros, so the sum of
    every rank's lookup is the full embedding (the sum is the caller's: g, or sequence parallelism's reduce-scatter)."""

    def __init__(self, full, group):
        super().__init__()
        self.group, (self.start, length) = group, my_vocab(full.num_embeddings, group)
        self.shards = {"weight": (0, self.start, length)}   # the baseline's coordinates (checkpoints, --check)
        self.weight = nn.Parameter(full.weight.detach().narrow(0, self.start, length).clone())

    def forward(self, tokens):
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        # row 0 stands in for a token outside my rows, and its vector is then zeroed (its gradient too)
        return F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)


class VocabParallelEmbed(nn.Module):
    """The gpt's block 0 (mp.models.TokenEmbed) on my rows of the vocabulary: the partial embeddings summed
    over tp by g (the lesson's reduce_from_tp_region), then the replicated position embedding. Sequence
    parallel: a reduce-scatter in g's place leaves me my run of tokens, and pos is added to those only (its
    gradient is then partial, summed over tp after the backward: mp.tp.sequence)."""

    def __init__(self, full, group, reduce_from_tp_region, sequence_parallel=False):
        super().__init__()
        self.tok, self.pos, self.group = VocabParallelEmbedding(full.tok, group), full.pos, group   # TokenEmbed's names
        self.sequence_parallel = sequence_parallel
        self.reduce = reduce_scatter_to_sequence_parallel_region if sequence_parallel else reduce_from_tp_region
        full.tok.weight.vocab_shard = self.tok.weight   # a tied head finds my slice here (VocabParallelHead)
        if sequence_parallel:
            self.pos.sequence_parallel = True   # added to my tokens only: a partial gradient, summed over tp

    def forward(self, tokens):
        x = self.reduce(self.tok(tokens), self.group)   # exact: one rank adds the vector, the others zeros
        first = tp_rank(self.group) * x.shape[1] if self.sequence_parallel else 0
        return x + self.pos.narrow(1, first, x.shape[1])


class VocabParallelHead(nn.Module):
    """The gpt's last block (mp.models.LMHead) on my rows of the vocabulary: LayerNorm (replicated), then
    my logits [b, s, V/T], from my rows of the weight, or tied, from the embedding's slice (the same
    Parameter: autograd sums both uses' gradients, as in one process). enter: f (copy_to_tp_region: its
    backward sums the ranks' input gradients), or under sequence parallelism the all-gather of the tokens
    (after the LayerNorm on my tokens, whose gradients are then partial)."""

    def __init__(self, full, group, enter, sequence_parallel=False):
        super().__init__()
        self.ln, self.group, self.enter = full.ln, group, enter
        start, length = my_vocab(full.weight.shape[0], group)
        self.shards = {"weight": (0, start, length)}
        tied = getattr(full.weight, "vocab_shard", None)   # set by VocabParallelEmbed on the full tied weight
        self.weight = tied if tied is not None else nn.Parameter(full.weight.detach().narrow(0, start, length).clone())
        if sequence_parallel:
            partial_gradients(self.ln)

    def forward(self, x):
        return self.enter(self.ln(x), self.group) @ self.weight.T


# ----------------------------------------------------------------------------- the loss without the full logits


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Each token's cross-entropy from my columns of its logits [..., V/T] (targets [...], IGNORE: 0, no
    gradient): three reductions over tp of [...]-sized tensors, never the [..., V] logits."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        start, n = tp_rank(group) * logits.shape[-1], logits.shape[-1]
        top = logits.max(dim=-1).values
        if tp_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)   # the max over the whole vocabulary
        exp = (logits - top.unsqueeze(-1)).exp_()   # shifted by the max, no exp overflows
        local = targets - start
        outside = (local < 0) | (local >= n)        # another rank's target, or IGNORE (-100)
        local = local.masked_fill(outside, 0)
        target_logit = (logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - top).masked_fill(outside, 0)
        # the sum of exponentials and the target's shifted logit: both SUMs in one all-reduce
        total, target_logit = all_reduce(torch.stack([exp.sum(-1), target_logit]), group, in_place=True)
        valid = targets != IGNORE
        softmax = exp.div_(total.unsqueeze(-1))     # in place: the exponentials are not needed again
        ctx.save_for_backward(softmax, local, outside, valid)
        return (total.log() - target_logit).masked_fill(~valid, 0)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside, valid = ctx.saved_tensors
        # d loss / d my logits = softmax - one-hot(target) on my columns, scaled by the upstream gradient
        mine = (~outside).unsqueeze(-1).to(softmax.dtype)   # 1 where my columns hold the target
        one_hot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), mine)
        return (softmax - one_hot) * (grad * valid).unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits, targets, group):
    """Each token's cross-entropy [...] (0 where the target is IGNORE), from my vocabulary columns [..., V/T]."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)


def vocab_parallel_token_sum(logits, targets, group):
    """mp.loss.token_sum from my vocabulary columns: the sum of the valid tokens' cross-entropies."""
    return sum_in_float64(vocab_parallel_cross_entropy(logits, targets, group))   # 0 where left out


def tp_loss_function(args, data, step, group, pieces=1):
    """The loss of step's batch, loss(my logits, targets): the gpt's token sum from my vocabulary
    columns, scaled by mp.loss.loss_function (pieces: its equal pieces, parallel_3d.py's microbatches x
    replicas); the image models' (whole logits) as they are."""
    if args.model != "gpt":
        return loss_function(args, data, step, pieces)
    return loss_function(args, data, step, pieces, sum_of=partial(vocab_parallel_token_sum, group=group))


def vocab_parallel_argmax(logits, group):
    """torch.argmax over the whole vocabulary from my columns: the largest value (all-reduce MAX), then the
    smallest index among the ranks that hold it (all-reduce MIN), as argmax breaks ties by the first index."""
    value, index = logits.max(dim=-1)
    if tp_size(group) == 1:
        return index
    top = value.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    index = torch.where(value == top, index + tp_rank(group) * logits.shape[-1], torch.iinfo(index.dtype).max)
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
    return index


def vocab_parallel_scores(args, group):
    """mp.loop.evaluate's scores(logits, labels) for my vocabulary columns (the gpt); None: its default."""
    if args.model != "gpt":
        return None

    def scores(logits, labels):
        return (vocab_parallel_token_sum(logits, labels, group),
                (vocab_parallel_argmax(logits, group) == labels).sum())
    return scores
