"""--balance auto: the split of consecutive blocks over a pipeline's stages (or its interleaved
chunks) whose slowest stage costs least, by a cost computed from the model, not measured.

A block's cost is the floating-point operations of its forward and backward on one sample
(torch.utils.flop_counter: the matrix products and convolutions, which are nearly all of the work),
counted on a zero sample as it flows through the model. A count, not a clock: the same model and
flags give the same split on every rank and every machine, so every rank can resolve `auto` by
itself before any collective and all agree. The counted shares follow the measured ones
(benchmarks/block_costs.py, docs/questions.md): the cnn's two convolutions are 90% of the count
and 89% of the time.

    costs = block_flops(args)                 # [flops of block 0, block 1, ...]
    slowest, sizes = best_split(costs, 4)     # e.g. the cnn: sizes [1, 1, 1, 2]
    slowest, sizes = v_split(costs, 2)        # zbv: 4 chunks, rank r holding chunks r and 3-r

zbv's V gives each rank two chunks that are not neighbours (rank 0 the model's first and last), so
what has to be even is the sum of a rank's two chunks, not each chunk: v_split minimises the slowest
rank's sum, then, among the splits that reach it, the largest chunk (the V's ticks assume chunks alike).

Block 0's input (the images) needs no gradient, so its backward computes only the weight gradient,
as on stage 0; every later block's input does, as on every other stage. Dropout does not run here
(no training step is set), and the activations' own work (GELU, norms, pooling) is not counted:
elementwise, small beside the products on these models.
"""
import torch
from torch.utils.flop_counter import FlopCounterMode

from mp.dropout import DropoutKeys
from mp.models import model_blocks, zero_sample


def block_flops(args):
    """Forward + backward flops of each block for one sample, in order. The blocks are built one at
    a time from --seed and dropped after their count, so no more than one is ever held."""
    costs, x = [], zero_sample(args)
    for i, block in enumerate(model_blocks(args, DropoutKeys(args.seed))):
        x = x.detach().requires_grad_(i > 0)
        with FlopCounterMode(display=False) as counter:
            y = block(x)
            y.backward(torch.ones_like(y))
        costs.append(counter.get_total_flops())
        x = y
    return costs


def best_split(costs, stages):
    """(cost of the slowest stage, block counts per stage): consecutive blocks, every stage at least
    one, the slowest stage as cheap as it can be. A dynamic programme over (blocks used, stages
    used); among splits that tie it keeps the first it meets, earlier stages taking fewer blocks."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[(end, s)]: (slowest stage, block counts) of the cheapest way to put blocks [0, end) on s stages
    best = {(0, 0): (0, [])}
    for s in range(1, stages + 1):
        for end in range(s, n - (stages - s) + 1):      # leave a block at least for each later stage
            options = []
            for start in range(s - 1, end):              # stage s holds blocks [start, end)
                if (start, s - 1) in best:
                    slowest, sizes = best[(start, s - 1)]
                    options.append((max(slowest, prefix[end] - prefix[start]), sizes + [end - start]))
            best[(end, s)] = min(options, key=lambda o: o[0])
    return best[(n, stages)]


def v_split(costs, ranks):
    """(cost of the slowest rank, block counts per chunk) for zbv's 2 x ranks chunks, rank r holding
    chunks r and 2*ranks-1-r. Built from both ends inward: after r ranks, chunks 0..r-1 hold blocks
    [0, i) and the last r chunks [j, n); rank r then takes [i, a) and [b, j), and the last rank's two
    chunks meet in the middle (b = a). Two passes of the same search: the least slowest-rank sum, then
    the least largest chunk among the splits within that sum."""
    n, prefix = len(costs), [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def search(score, bound):
        best = {(0, n): (0, [], [])}                 # (i, j) -> (worst score so far, head sizes, tail sizes)
        for r in range(ranks):
            inner, ahead = 2 * (ranks - r - 1), {}   # chunks still to place between this rank's two
            for (i, j), (worst, head, tail) in best.items():
                for a in range(i + 1, j - inner):
                    for b in ([a] if inner == 0 else range(a + inner, j)):
                        x, y = prefix[a] - prefix[i], prefix[j] - prefix[b]
                        if bound is not None and x + y > bound:
                            continue
                        option = (max(worst, score(x, y)), head + [a - i], [j - b] + tail)
                        if (a, b) not in ahead or option[0] < ahead[(a, b)][0]:
                            ahead[(a, b)] = option
            best = ahead
        worst, head, tail = min(best.values(), key=lambda o: o[0])
        return worst, head + tail

    slowest, _ = search(lambda x, y: x + y, None)
    return slowest, search(max, slowest)[1]


def rank_max(costs, split):
    """The cost of zbv's slowest rank under `split` (block counts per chunk, 2 chunks a rank in a V)."""
    chunks = [sum(costs[sum(split[:k]):sum(split[:k + 1])]) for k in range(len(split))]
    return max(chunks[r] + chunks[-1 - r] for r in range(len(split) // 2))


def stage_max(costs, split):
    """The cost of the slowest stage of `split` (block counts per stage)."""
    out, start = [], 0
    for k in split:
        out.append(sum(costs[start:start + k]))
        start += k
    return max(out)


def auto_balance(args, chunks, v=False):
    """--balance auto as the explicit list --balance takes, e.g. "1,1,1,2" (v: zbv's V of chunks)."""
    costs = block_flops(args)
    return ",".join(map(str, (v_split(costs, chunks // 2) if v else best_split(costs, chunks))[1]))


def resolve_balance(args, stages):
    """After the flags' checks (mp.pp.flags, which found that the chunks fit the blocks): --balance
    auto becomes the list it stands for, so that the log records the split that ran. Counting the
    flops runs the blocks, so it needs torch and waits until the program, not the launcher, parses."""
    if args.balance == "auto":
        args.balance = auto_balance(args, stages * args.virtual_stages, v=args.schedule == "zbv")
