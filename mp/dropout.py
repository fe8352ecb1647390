"""Dropout that every parallel layout draws alike: each element's mask is a pure function of
(--seed, step, the sample's index in the global batch, the layer, the element's index in the full layer).

Why not torch's dropout: it draws from a stateful generator, so the mask depends on how many
numbers were drawn before, on which process, in which order. A microbatch, a data-parallel
replica, a tensor-parallel shard, a pipeline stage and a recomputed forward would each draw other
bits than the one-process baseline, and the losses would part after the first step. Megatron
accepts that (each tensor-parallel rank seeds its own generator, `seed + 2718 + tp_rank`).

Here the bit of one element is a hash of its coordinates, as counter-based generators (Philox,
Threefry) make random numbers from a key and a counter: no state, so any process can compute the
bits of exactly the elements it holds, in any order, any number of times, on the CPU or a GPU
(integer arithmetic is exact on both). The hash is a 32-bit integer mixer (Wellons's "lowbias32")
applied along the coordinates:

    h = mix(mix(mix(mix(mix(seed) ^ step) ^ layer) ^ sample) ^ element)    keep the element if h >= p * 2^32

The key mix(mix(mix(seed) ^ step) ^ layer) is the same for every element: it is computed on the
host as a Python int and enters the tensor ops as a scalar, so drawing a mask copies nothing from
the host to the device and never waits for it. The per-element mixes run in place on one int64
buffer (values below 2^32, so no product overflows) with one scratch buffer beside it; the mask is
bool, the one thing autograd saves (1 byte an element).
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn

MASK32 = 0xFFFFFFFF
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B     # lowbias32's two multipliers


def mix(x):
    """lowbias32 on a Python int in [0, 2^32): every input bit flips about half of the output bits."""
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def _xorshift_(h, k, scratch):
    """h ^= h >> k in place, the shift written into scratch (torch has no fused in-place form)."""
    torch.bitwise_right_shift(h, k, out=scratch)
    h.bitwise_xor_(scratch)


def mix_(h, scratch):
    """mix on every element of an int64 tensor with values in [0, 2^32), in place; scratch: a
    buffer of h's shape and dtype. Equal to mix() element by element."""
    _xorshift_(h, 16, scratch)
    h.mul_(MUL1).bitwise_and_(MASK32)           # MUL1 < 2^31: the product stays below 2^63
    _xorshift_(h, 15, scratch)
    # MUL2 >= 2^31 would overflow int64; MUL2 - 2^32 is the same residue mod 2^32, of magnitude
    # < 2^31, and & MASK32 of the negative product (two's complement) is that residue.
    h.mul_(MUL2 - 2**32).bitwise_and_(MASK32)
    _xorshift_(h, 16, scratch)
    return h


def keep_mask(seed, step, layer, samples, elements, p):
    """Bool [len(samples), len(elements)]: which elements survive dropout with probability p.
    seed, step, layer: Python ints; samples, elements: int64 tensors on the activation's device."""
    key = mix(mix(mix(seed & MASK32) ^ (step & MASK32)) ^ layer)       # host arithmetic, no tensor
    per_sample = samples.bitwise_and(MASK32).bitwise_xor_(key)
    mix_(per_sample, torch.empty_like(per_sample))
    h = per_sample[:, None] ^ (elements & MASK32)[None, :]               # the one activation-sized buffer
    mix_(h, torch.empty_like(h))
    return h >= int(p * 2**32)


class DropoutKeys:
    """What a mask depends on besides the element: the seed, the step (None: not training, no
    dropout) and the global index of the first sample in the batch being run. One object per model,
    shared by its dropout layers; the training loop sets step and first_sample."""

    def __init__(self, seed):
        self.seed, self.step, self.first_sample = seed, None, 0

    @contextmanager
    def training(self, step, first_sample=0):
        self.step, self.first_sample = step, first_sample
        try:
            yield
        finally:
            self.step, self.first_sample = None, 0


class KeyedDropout(nn.Module):
    """nn.Dropout's contract (zero each element with probability p, scale the rest by 1/(1-p)),
    with keyed masks. x is [samples, ...]; the element index is the flat index of the rest in the
    full layer. shard = (start, full): this rank holds features start.. of `full` along the last
    dimension (tensor parallelism sets it after a column-parallel layer). first_token: this rank
    holds tokens first_token.. along dimension 1 (sequence parallelism sets it on a token shard)."""

    def __init__(self, p, layer, keys):
        super().__init__()
        self.p, self.layer, self.keys, self.shard, self.first_token = p, layer, keys, None, 0

    def forward(self, x):
        if self.p == 0 or self.keys is None or self.keys.step is None:
            return x
        n, rest = x.shape[0], x.shape[1:]
        samples = self.keys.first_sample + torch.arange(n, device=x.device)
        if self.shard is None and self.first_token == 0:
            elements = torch.arange(math.prod(rest), device=x.device)
        else:
            start, full = self.shard or (0, rest[-1])
            # the rows (all but the last dimension) of the full layer that mine are: a token shard
            # starts first_token rows of dimension 1 in, each of prod(rest[1:-1]) rows
            first_row = self.first_token * math.prod(rest[1:-1])
            lead = (first_row + torch.arange(math.prod(rest[:-1]), device=x.device))[:, None] * full
            elements = (lead + start + torch.arange(rest[-1], device=x.device)[None, :]).reshape(-1)
        keep = keep_mask(self.keys.seed, self.keys.step, self.layer, samples, elements, self.p)
        # where() saves only the bool mask for backward; the scale is a Python scalar (nothing saved)
        return torch.where(keep.view_as(x), x * (1.0 / (1.0 - self.p)), 0)

    def extra_repr(self):
        return (f"p={self.p}, layer={self.layer}" + (f", shard={self.shard}" if self.shard else "")
                + (f", first_token={self.first_token}" if self.first_token else ""))
