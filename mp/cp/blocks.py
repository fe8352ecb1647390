"""The first and last blocks of the vit and the gpt on my tokens (context_parallel.py; the attention between
them is the lesson's): the embedding keeps my tokens, each at its true position (mp/cp/zigzag.py), the vit's
head pools over every rank's tokens (an explicit all-reduce), the gpt's is per token and needs no change;
and the evaluation's run that gathers the gpt's logits whole."""
import torch
import torch.distributed as dist
import torch.nn as nn

from mp.cp.zigzag import gather_sequence
from mp.models import PatchEmbed


def cp_rank(group):
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def cp_size(group):
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def my_tokens(group, tokens):
    """(first, count): my run of the sequence's tokens, equal contiguous shards in rank order (the vit's)."""
    count = tokens // cp_size(group)
    return count * cp_rank(group), count


class ContextParallelTokenEmbed(nn.Module):
    """The gpt's embedding of my tokens only (the input bytes are whole on every rank), each plus its TRUE
    position's vector: under the zigzag my tokens are two runs, chunk r's and chunk 2C-1-r's."""

    def __init__(self, full, positions):
        super().__init__()
        self.tok, self.pos = full.tok, full.pos   # TokenEmbed's names
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, tokens):
        return self.tok(tokens[:, self.positions]) + self.pos[:, self.positions]


class ContextParallelEmbed(nn.Module):
    """The patch embedding, then my run of tokens: every rank embeds the whole image (the input is
    whole everywhere, and the embedding is not saved for backward) and keeps a copy of its tokens."""

    def __init__(self, full, group):
        super().__init__()
        self.conv, self.pos, self.group = full.conv, full.pos, group   # PatchEmbed's names
        self.tokens = full.pos.shape[1]

    def forward(self, x):
        # a copy, not a view: a view would keep the whole sequence's embedding alive
        mine = PatchEmbed.forward(self, x).narrow(1, *my_tokens(self.group, self.tokens))
        return mine.clone(memory_format=torch.contiguous_format)


class _ReduceFromCP(torch.autograd.Function):
    """Forward all-reduce (sum the ranks' shares of the pooled mean); backward identity (the gradient of
    the sum with respect to each share is the sum's gradient, whole on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ContextParallelHead(nn.Module):
    """The head on my tokens: LayerNorm, my tokens' share of the mean over all T, summed over the ranks
    (explicitly: the only place the sequence is whole again), then the classifier on every rank."""

    def __init__(self, full, group, tokens):
        super().__init__()
        self.ln, self.fc, self.group, self.tokens = full.ln, full.fc, group, tokens   # Head's names

    def forward(self, x):
        share = self.ln(x).sum(dim=1) / self.tokens
        return self.fc(_ReduceFromCP.apply(share, self.group) if cp_size(self.group) > 1 else share)


def sequence_run(model, device, group):
    """evaluate()'s run for the gpt: my tokens' logits, gathered whole in the true order on every rank."""
    def run(batches, score):
        for i, (x, _) in enumerate(batches):
            score(i, gather_sequence(model(x.to(device)), model.layout, group))
    return run
