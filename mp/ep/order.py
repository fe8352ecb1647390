"""Which tokens come first in an expert's capacity when a microbatch's tokens are split many ways.

The baseline routes a microbatch's tokens in one order: slot-major (every token's first choice, then
every second choice), and within a slot sample-major (sample 0's tokens 0..S-1, then sample 1's ...).
expert_parallel.py splits the batch by samples, so a rank's tokens are one contiguous run of that
order, and mp.moe.ahead_of over the ranks' counts gives each rank what comes before it. In 5-D the
tokens of ONE sample are split too: over cp (S/C tokens each) and, under sequence parallelism, over tp.
So a rank holds many short runs, one per (sample, token chunk): a block. Per-rank counts are not
enough then, the blocks of different ranks interleave:

    microbatch of 2 samples, cp 2:   s0 c0 | s0 c1 | s1 c0 | s1 c1        the baseline's order
                                     rank0   rank1   rank0   rank1        who holds each block

Every rank counts its choices per block, the counts of all blocks are gathered, sorted into the
baseline's order, and mp.moe.ahead_of (which only needs blocks in order) and kept_counts run on the
blocks. A rank's own earlier tokens count within its block only. With one block per rank (contiguous
slices) this is expert_parallel.py's arithmetic exactly.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def sample_counts(choice, samples, experts):
    """[b, K, E]: how many of each of my samples' tokens chose each expert as their k-th choice.
    choice: [b * t, K], sample-major."""
    one_hot = F.one_hot(choice, experts).view(samples, -1, *choice.shape[1:], experts)   # [b, t, K, E]
    return one_hot.sum(dim=1)


def gather(x, group):
    """[group size, *x.shape]: x of every rank of the group, in group-rank order."""
    every = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, x.contiguous(), group=group)
    return torch.stack(every)


def gather_blocks(mine, dp_cp_group, dp, cp, tp_group=None, even=True):
    """(every block's counts in the baseline's order, [D, b, C, T, K, E] (T: 1 without tp), the samples they
    hold). mine: my samples' counts [b, K, E]; gathered over the tp group first (each tp rank one token chunk
    of my cp chunk), then over dp x cp (rank r = dp_rank * C + cp_rank). even=False (the evaluation, whose
    test batch D need not divide: the replicas' slices differ by a sample): the replicas' sample counts are
    gathered first (a read), and each rank's counts padded with zero rows to the most, so that a padding row
    is a block that chose no expert: it moves no count, no place in the order and no capacity."""
    samples = mine.shape[0] * dp
    if not even:
        sizes = gather(torch.tensor([mine.shape[0]], device=mine.device), dp_cp_group).view(-1).tolist()
        samples = sum(sizes[::cp])                                             # a replica's cp ranks: the same
        mine = torch.cat([mine, mine.new_zeros(max(sizes) - mine.shape[0], *mine.shape[1:])])
    by_tp = gather(mine, tp_group) if tp_group is not None else mine[None]      # [T, b, K, E]
    every = gather(by_tp, dp_cp_group)                                         # [D*C, T, b, K, E]
    t, b = by_tp.shape[:2]
    # the baseline's order: samples (replica-major: a replica's samples are consecutive), then token
    # chunks (cp chunk, then tp chunk inside it)
    return every.view(dp, cp, t, b, *mine.shape[1:]).permute(0, 3, 1, 2, 4, 5), samples


def in_order(blocks):
    """[D, b, C, T, K, E] -> [blocks, K, E], the baseline's order (what mp.moe.ahead_of reads)."""
    return blocks.reshape(-1, *blocks.shape[-2:])


def from_order(flat, shape):
    """in_order's inverse: [blocks, K, E] in the baseline's order -> [D, b, C, T, K, E]."""
    return flat.view(shape)


def per_rank(blocks):
    """[D, b, C, T, K, E] -> [D*C*T, K, E]: each rank's (dp, cp, tp order) total over its samples."""
    return blocks.sum(dim=1).reshape(-1, *blocks.shape[-2:])


def kept_mask_blocks(choice, ahead, capacity):
    """Bool [b * t, K]: which of my tokens' choices fit their expert's capacity. ahead: [b, K, E], how
    many choices of each expert come before each of my blocks in the baseline's order; my tokens are
    b blocks (one per sample) of t tokens each, choice sample-major [b * t, K]."""
    if capacity is None:
        return torch.ones_like(choice, dtype=torch.bool)
    samples, experts = ahead.shape[0], ahead.shape[-1]
    keep = []
    for k, c in enumerate(choice.unbind(dim=1)):
        one_hot = F.one_hot(c, experts).view(samples, -1, experts)               # [b, t, E]
        before = (one_hot.cumsum(dim=1) - one_hot).view(-1, experts).gather(1, c[:, None])[:, 0]   # in my block
        first = ahead[:, k].gather(1, c.view(samples, -1))                       # [b, t]: the blocks before mine
        keep.append(first.reshape(-1) + before < capacity)
    return torch.stack(keep, dim=1)
