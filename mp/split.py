"""The 5-D data split (parallel_5d.py), once over the (dp, cp) coordinates: microbatch m of the baseline
(`single_baseline.py --microbatches M`) is samples m*B/M .. (m+1)*B/M - 1, and replica d runs its b = B/(M*D) of
them as its own microbatch m (each cp rank embeds those whole images and keeps its tokens). So a microbatch
routes the baseline's tokens through its mixture of experts, and dropout draws the baseline's masks."""
import torch

from mp.data import to_device
from mp.dropout import DropoutKeys


def my_microbatches(data, step, args, mesh, pos, device, layout=None):
    """My part of every microbatch of the baseline: replica d's b = B/(M*D) samples of microbatch m
    (m*B/M + d*b ...), as a list for the first stage (each cp rank embeds the whole images and keeps
    its tokens), and their labels, microbatch after microbatch, for the last stage. layout (the gpt's,
    mp/cp/zigzag.py): the targets of my cp rank's tokens only, at their true positions."""
    batch, b = args.batch_size, my_share(args.batch_size, args.microbatches, mesh.dp_size)
    firsts = my_firsts(batch, args.microbatches, mesh.dp_rank, mesh.dp_size)
    x = [to_device(data.images(step, batch, f, b), device) for f in firsts] if pos.is_first_stage else None
    y = None
    if pos.is_last_stage:
        labels = data.labels(step, batch)
        y = to_device(torch.cat([labels[f:f + b] for f in firsts]), device)
        y = y if layout is None else layout.take(y, mesh.cp_rank)
    return x, y


def my_share(batch, microbatches, dp):
    """b = B/(M*D): how many samples of each baseline microbatch a replica runs (mp.pp.flags checks that it divides)."""
    return batch // (microbatches * dp)


def my_firsts(batch, microbatches, dp_rank, dp):
    """The baseline batch's index of my first sample in each microbatch: m*B/M + d*b."""
    b = my_share(batch, microbatches, dp)
    return [k * (batch // microbatches) + dp_rank * b for k in range(microbatches)]


def my_sample_indices(batch, microbatches, dp_rank, dp):
    """The baseline batch's indices of my samples, in the order my microbatches run them (my_microbatches):
    what --check compares my outputs with (mp.check)."""
    b = my_share(batch, microbatches, dp)
    return torch.cat([torch.arange(f, f + b) for f in my_firsts(batch, microbatches, dp_rank, dp)])


class MicrobatchMajorKeys(DropoutKeys):
    """The dropout keys (mp/dropout.py) with the baseline's sample indices. The pipeline's runner numbers
    my samples as one run (microbatch mb's first is mb * b); in the baseline it is mb * B/M + dp_rank * b."""

    def __init__(self, seed, batch, microbatches, dp_rank, dp):
        self.b, self.stride = my_share(batch, microbatches, dp), batch // microbatches
        self.offset = dp_rank * self.b
        super().__init__(seed)

    @property
    def first_sample(self):
        mb, i = divmod(self.local, self.b)
        return mb * self.stride + self.offset + i

    @first_sample.setter
    def first_sample(self, local):
        self.local = local
