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

Block 0's input (the images) needs no gradient, so its backward computes only the weight gradient,
as on stage 0; every later block's input does, as on every other stage. Dropout does not run here
(no training step is set), and the activations' own work (GELU, norms, pooling) is not counted:
elementwise, small beside the products on these models.
"""
import torch
from torch.utils.flop_counter import FlopCounterMode

from mp.dropout import DropoutKeys
from mp.models import model_blocks


def block_flops(args):
    """Forward + backward flops of each block for one sample, in order. The blocks are built one at
    a time from --seed and dropped after their count, so no more than one is ever held."""
    costs, x = [], torch.zeros(1, 3, 32, 32)
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


def stage_max(costs, split):
    """The cost of the slowest stage of `split` (block counts per stage)."""
    out, start = [], 0
    for k in split:
        out.append(sum(costs[start:start + k]))
        start += k
    return max(out)


def auto_balance(args, chunks):
    """--balance auto as the explicit list --balance takes, e.g. "1,1,1,2"."""
    return ",".join(map(str, best_split(block_flops(args), chunks)[1]))


def resolve_balance(args, stages):
    """After the flags' checks (mp.pp.flags, which found that the chunks fit the blocks): --balance
    auto becomes the list it stands for, so that the log records the split that ran. Counting the
    flops runs the blocks, so it needs torch and waits until the program, not the launcher, parses."""
    if args.balance == "auto":
        args.balance = auto_balance(args, stages * args.virtual_stages)
