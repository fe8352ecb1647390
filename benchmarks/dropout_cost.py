"""What keyed masks cost: KeyedDropout against F.dropout on the activations of this repository's models.

    python benchmarks/dropout_cost.py

Times the forward of one dropout layer (median of 50 after 5 warm-ups, one thread) on the shapes
the models drop: the cnn's [64, 16, 5, 5] and [64, 120], the mlp's [64, 1024], the vit's
[64, 64, 128]. F.dropout draws p from torch's generator (one Bernoulli per element); KeyedDropout
hashes five integers per element with 32-bit integer arithmetic in int64 tensors (about 20 tensor ops).
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp.dropout import DropoutKeys, KeyedDropout  # noqa: E402


def median_ms(fn, runs=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[runs // 2] * 1e3


def main():
    torch.set_num_threads(1)
    keys = DropoutKeys(seed=0)
    keyed = KeyedDropout(0.1, layer=0, keys=keys)
    print("| activation | F.dropout | KeyedDropout | ratio |\n| --- | --- | --- | --- |")
    for shape in [(64, 16, 5, 5), (64, 120), (64, 1024), (64, 64, 128)]:
        x = torch.randn(shape)
        with keys.training(step=0):
            plain, ours = median_ms(lambda: F.dropout(x, 0.1)), median_ms(lambda: keyed(x))
        print(f"| {list(shape)} | {plain:.3f} ms | {ours:.3f} ms | {ours / plain:.1f}x |")


if __name__ == "__main__":
    main()
