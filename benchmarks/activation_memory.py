"""What the cnn's stage 0 (its two conv blocks, the first stage of 4) saves for backward, per sample.

    python benchmarks/activation_memory.py

The bytes of every tensor autograd saves during one forward, counted once per storage, for a batch
of 1 and of 64; their difference over 63 is the cost of one more sample (the weights, saved too,
cancel out). This is what GPipe's stage 0 keeps for every sample of the batch until the backwards.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp.models import cnn_blocks  # noqa: E402


def saved_bytes(blocks, n):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocks(torch.randn(n, 3, 32, 32))
    return sum(storages.values())


if __name__ == "__main__":
    stage0 = torch.nn.Sequential(*list(cnn_blocks(torch.nn.Identity))[:2])   # no dropout
    per_sample = (saved_bytes(stage0, 64) - saved_bytes(stage0, 1)) / 63
    image = 3 * 32 * 32 * 4
    print(f"cnn stage 0 saves {per_sample / 1000:.1f} kB per sample for backward ({per_sample / 4:.0f} floats), "
          f"of which the input image is {image / 1000:.1f} kB")
