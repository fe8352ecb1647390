"""tensor_parallel.py --sequence-parallel, the vit's pieces (Korthikanti et al. 2022, "Reducing
activation recomputation in large transformer models"): the residual stream of every rank holds its
own run of the 64 tokens, [B, 64/t, H], through the LayerNorms, dropouts and residual adds.

    block 0 (embed)       blocks 1..L (transformer)                               block L+1 (head)
    patches -> [B,64,H]   [B,64/t,H] -LN-> all-gather -> attention | MLP          [B,64/t,H] -LN-> my share
    keep my 64/t tokens              (column ... row) -> reduce-scatter -> +x      of the mean -> all-reduce

The operators (gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region) are
mp.tp.mappings'; the sequence-parallel column and row layers are tensor_parallel.py's; this module splits the sequence
after the embedding, ends it in the head, keys the dropouts to my tokens, and marks the replicated
parameters that see my tokens only, whose gradients are then summed over the group (SummedGradients).
"""
import torch
import torch.nn as nn

from mp.dropout import KeyedDropout
from mp.models import PatchEmbed
from mp.sizes import VIT_TOKENS
from mp.tp.collectives import tp_rank, tp_size
from mp.replicas import SummedGradients



def my_tokens(group, tokens=VIT_TOKENS):
    """(first, count): the run of a sample's tokens (the vit's 64, the gpt's --seq-len) this rank holds
    under sequence parallelism."""
    count = tokens // tp_size(group)
    return count * tp_rank(group), count


def shard_sequence(i, block, group, n_blocks, reduce_from_tp_region, tokens=VIT_TOKENS):
    """Block i of the vit, already tensor-parallel, on my tokens: the embedding keeps my run of them,
    the head ends the sequence, and a transformer block's norms and dropouts see my tokens only.
    reduce_from_tp_region: the lesson's g (tensor_parallel.py), which sums the head's shares. tokens: a
    sample's (the gpt's transformer blocks come here too, its ends are mp.tp.vocab's)."""
    if i == 0:
        return SequenceParallelEmbed(block, group)
    if i == n_blocks - 1:
        return SequenceParallelHead(block, group, reduce_from_tp_region)
    partial_gradients(block.ln1, block.ln2)   # each rank normalises other tokens
    for drop in (block.drop1, block.drop2):
        if isinstance(drop, KeyedDropout):
            drop.first_token = my_tokens(group, tokens)[0]   # my tokens' masks: theirs in the full layer
    return block


def partial_gradients(*modules):
    """Mark replicated parameters that this rank applies to its own tokens only: each rank holds a
    partial gradient, and the whole one is their sum over the group (sum_sequence_parallel_grads)."""
    for p in (p for m in modules for p in m.parameters()):
        p.sequence_parallel = True


class SequenceParallelEmbed(nn.Module):
    """The patch embedding, then my run of tokens. The sequence is split here, after the only layer
    whose input is not tokens, with no communication: every rank embeds the whole image (replicated
    work, about 1% of a step) and keeps its tokens. Its backward pads the other tokens' gradient with
    zeros, so conv and pos get partial gradients, summed with the norms' (not a B x 64 x H all-gather)."""

    def __init__(self, full, group):
        super().__init__()
        self.conv, self.pos, self.group = full.conv, full.pos, group   # PatchEmbed's names
        partial_gradients(self)

    def forward(self, x):
        # a copy of my tokens, not a view: a view would keep the whole embedding alive for backward
        return PatchEmbed.forward(self, x).narrow(1, *my_tokens(self.group)).clone(memory_format=torch.contiguous_format)


class SequenceParallelHead(nn.Module):
    """The head on my tokens: LayerNorm, my tokens' share of the mean over all 64, then g (all-reduce)
    sums the shares into the whole [B, H] mean on every rank, and the classifier is replicated. The
    mean is the head's only mix of tokens, so it is where the sequence ends; reducing the pooled
    B x H moves 64 times fewer elements than gathering the B x 64 x H tokens first."""

    def __init__(self, full, group, reduce_from_tp_region):
        super().__init__()
        self.ln, self.fc, self.group = full.ln, full.fc, group   # Head's names
        self.reduce = reduce_from_tp_region
        partial_gradients(self.ln)

    def forward(self, x):
        share = self.ln(x).sum(dim=1) / VIT_TOKENS
        return self.fc(self.reduce(share, self.group))


def sum_sequence_parallel_grads(model, group):
    """The LayerNorms, row-parallel biases and patch embedding that act on my tokens only get partial
    gradients: one all-reduce, after the step's backward, sums them (then they are whole, and the same,
    on every rank). Returns the SummedGradients (None without sequence parallelism)."""
    params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    return SummedGradients(params, group) if params else None
