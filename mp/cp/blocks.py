"""The embeddings of the vit and the gpt on my tokens (context_parallel.py holds the attention and the vit
head's all-reduce): each keeps my tokens, at their true positions (mp/cp/zigzag.py); and the evaluation's
run that gathers the gpt's logits whole (its head is per token)."""
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


def sequence_run(model, device, group):
    """evaluate()'s run for the gpt: my tokens' logits, gathered whole in the true order on every rank."""
    def run(batches, score):
        for i, (x, _) in enumerate(batches):
            score(i, gather_sequence(model(x.to(device)), model.layout, group))
    return run
