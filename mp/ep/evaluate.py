"""Expert parallelism's evaluation and traffic count.

The evaluation cannot run the whole test batch on one rank: its tokens must reach experts that live on
every rank, and every rank must take part in each all-to-all. So each rank sends its slice of each test
batch through the model (tensor_split: the baseline's order, so the capacity drops the same tokens), and
the slices' logits are gathered whole on every rank for mp.loop.evaluate's score.
"""
import math

import torch
import torch.distributed as dist

from mp.sizes import split_sizes


def sliced_run(model, device, group):
    """mp.loop.evaluate's run: my slice of each batch through the model, every rank's logits gathered."""
    n, me = dist.get_world_size(group), dist.get_rank(group)

    def run(batches, score):
        for i, (x, _) in enumerate(batches):
            sizes = split_sizes(len(x), n)
            mine = model(x.tensor_split(n)[me].to(device))
            padded = mine.new_zeros(sizes[0], *mine.shape[1:])        # all_gather wants equal shapes
            padded[:len(mine)] = mine
            every = [torch.empty_like(padded) for _ in range(n)]
            dist.all_gather(every, padded, group=group)
            score(i, torch.cat([part[:size] for part, size in zip(every, sizes)]))
    return run


class Traffic:
    """The bytes this rank's all-to-alls send to other ranks (its own rows stay, a local copy), counted
    from the splits on the host: nothing read back from the device."""

    def __init__(self):
        self.bytes = 0

    def add(self, rows, send_splits, me):
        self.bytes += (sum(send_splits) - send_splits[me]) * math.prod(rows.shape[1:]) * rows.element_size()
