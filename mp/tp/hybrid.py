"""tensor_parallel.py --hybrid: Krizhevsky's "One weird trick" (2014, arXiv:1404.5997) on the cnn.

Convolutions hold most
of the compute and few of the weights, so they run data-parallel; the fc layers hold most of the
weights and little of the compute, so they stay tensor-parallel. One all-gather switches between the two:

    torchrun --standalone --nproc-per-node 2 tensor_parallel.py --data synthetic --hybrid

    rank 0:  X[0:B/2] --conv blocks (replicated)--+                                    +-- logits
                                                  all-gather along the batch --> fc1 | fc2, fc3
    rank 1:  X[B/2:B] --conv blocks (replicated)--+  (backward: keep my slice)         +-- logits

The conv weights' gradients are summed over the ranks in one all-reduce after backward (the step
calls partial_grads.sum()).

The tensor-parallel layers are tensor_parallel.py's; this module adds the switch (gather_from_dp_region)
and the model that runs it (HybridCNN); its flag check is mp.tp.flags.validate_hybrid.
"""
import torch.nn as nn

from mp.sizes import split_sizes
from mp.tp.collectives import tp_rank, tp_size
from mp.tp.mappings import gather_from_tp_region
from mp.replicas import SummedGradients


def gather_from_dp_region(x, group, sizes):
    """--hybrid's switch from data- to tensor-parallel: forward all-gather along the batch (each rank
    has its samples' features; the fc layers need every sample); backward keep my slice of the
    gradient. The backward needs no communication because the f in front of fc1 has already
    all-reduced the feature gradient: it is whole, and the same, on every rank."""
    return gather_from_tp_region(x, group, sizes, dim=0)


class HybridCNN(nn.Sequential):
    """Krizhevsky's one weird trick on the cnn: blocks 0-1 (the convolutions, 2,904 weights, ~90% of the
    multiply-adds) replicated and data-parallel; blocks 2-4 (the fc layers, 59,134 weights) tensor-parallel.
    The same blocks under the same names as the full model; the whole global batch in, whole logits out."""

    CONV_BLOCKS = 2

    def __init__(self, model, group):
        super().__init__(*model)   # blocks 2-4 already made tensor-parallel (parallelize_block)
        self.group, self.full_param_mb, self.dropout_keys = group, model.full_param_mb, model.dropout_keys
        self.partial_grads = SummedGradients(
            [p for block in list(self)[:self.CONV_BLOCKS] for p in block.parameters()], group)

    def forward(self, x):
        # training batches split evenly (validate_hybrid); a test chunk may not (500 over 3 ranks), so
        # tensor_split's sizes, which the padded all-gather accepts
        sizes = split_sizes(x.shape[0], tp_size(self.group))
        x = x.tensor_split(len(sizes))[tp_rank(self.group)]  # my contiguous slice: no communication
        blocks, keys = list(self), self.dropout_keys
        whole_batch, keys.first_sample = keys.first_sample, keys.first_sample + sum(sizes[:tp_rank(self.group)])
        for block in blocks[:self.CONV_BLOCKS]:  # GroupNorm's statistics are per sample: exact on a slice
            x = block(x)                          # (and the dropout ending block 1 keys my samples' masks)
        keys.first_sample = whole_batch
        x = gather_from_dp_region(x, self.group, sizes)
        for block in blocks[self.CONV_BLOCKS:]:
            x = block(x)
        return x
