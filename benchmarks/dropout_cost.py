"""What keyed masks cost: KeyedDropout against F.dropout (what nn.Dropout calls), before and after
its 2026-11-25 rewrite, on the activations of this repository's models.

    python benchmarks/dropout_cost.py [--rounds 40]

The shapes are the ones the models drop: the cnn's [64, 16, 5, 5] and [64, 120], the mlp's
[64, 1024], the vit's [64, 64, 128]. Paired timing in one process on one thread: each round times
F.dropout, the old KeyedDropout and the new one back to back (in a rotating order, each over enough
calls to last about a millisecond) in this thread's CPU time, which other jobs on a shared machine
inflate far less than wall-clock time; a round's ratio is its keyed time over its F.dropout time,
so what load is left slows both sides of a ratio alike. Printed: the median over rounds, for the
forward alone and for forward + backward; then the bytes per element that autograd saves for
backward, counted with torch.autograd.graph.saved_tensors_hooks.

"Before" is mp/dropout.py as of commit 3f40a97 (the last before the rewrite), kept here to be timed
(its unsharded path): its key went through a 0-dim CPU tensor and `.to(device)`, every step of its
mix made a fresh int64 temporary, and its mask was a float tensor. tests/test_keyed_dropout.py
checks that both draw the same masks.
"""
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp.dropout import MASK32, DropoutKeys, KeyedDropout  # noqa: E402
from mp.flags import OneLineParser  # noqa: E402

SHAPES = [(64, 16, 5, 5), (64, 120), (64, 1024), (64, 64, 128)]
P = 0.1


# ---- the implementation before 2026-11-25, as it was ------------------------------------------

def _mul32_before(x, c):
    r = (x * (c & 0x7FFFFFFF)) & MASK32
    if c >> 31:
        r = (r + ((x << 31) & MASK32)) & MASK32
    return r


def mix_before(x):
    x = x ^ (x >> 16)
    x = _mul32_before(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32_before(x, 0x846CA68B)
    return x ^ (x >> 16)


def keep_mask_before(seed, step, layer, samples, elements, p):
    key = mix_before(mix_before(mix_before(torch.tensor(seed & MASK32)) ^ (step & MASK32)) ^ layer)
    per_sample = mix_before(key.to(samples.device) ^ (samples & MASK32))
    h = mix_before(per_sample[:, None] ^ (elements[None, :] & MASK32))
    return h >= int(p * 2**32)


def keyed_before(x, keys, layer, p):
    """The old KeyedDropout.forward on an unsharded activation."""
    samples = keys.first_sample + torch.arange(x.shape[0], device=x.device)
    elements = torch.arange(math.prod(x.shape[1:]), device=x.device)
    keep = keep_mask_before(keys.seed, keys.step, layer, samples, elements, p)
    return x * keep.view_as(x).to(x.dtype) * (1.0 / (1.0 - p))


# ---- measuring ----------------------------------------------------------------------------------

def seconds(fn, calls):
    """CPU seconds of this thread for `calls` calls (one intra-op thread: the ops run on it), which
    the other jobs on a shared machine do not inflate as they do wall-clock time."""
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return time.thread_time() - start


def paired_ratios(fns, rounds):
    """{name: median over rounds of (its time / fns[0]'s time in the same round)}, and fns[0]'s
    median time per call in ms. fns: [(name, fn)], the reference first."""
    calls = max(1, math.ceil(1e-3 / max(seconds(fns[0][1], 3) / 3, 1e-7)))
    for _, fn in fns:
        seconds(fn, 3)                                   # warm-up
    times = {name: [] for name, _ in fns}
    for r in range(rounds):
        for name, fn in fns[r % len(fns):] + fns[:r % len(fns)]:   # rotate who goes first
            times[name].append(seconds(fn, calls) / calls)
    ref = times[fns[0][0]]
    ratios = {name: sorted(t / b for t, b in zip(ts, ref))[rounds // 2] for name, ts in times.items()}
    return ratios, sorted(ref)[rounds // 2] * 1e3


def saved_bytes_per_element(fn, shape):
    """Bytes of the tensors autograd saves for backward in fn(x), per element of x."""
    x = torch.randn(shape, requires_grad=True)
    total = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        fn(x)
    return sum(total) / x.numel()


def with_backward(fn, x, grad):
    def run():
        x.grad = None
        fn(x).backward(grad)
    return run


def main():
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keys = DropoutKeys(seed=0)
    keyed = KeyedDropout(P, layer=0, keys=keys)
    fns = [("F.dropout", lambda x: F.dropout(x, P)), ("before", lambda x: keyed_before(x, keys, 0, P)),
           ("after", keyed)]
    print("| activation | pass | F.dropout | before / F.dropout | after / F.dropout |\n| --- | --- | --- | --- | --- |")
    with keys.training(step=0):
        for shape in SHAPES:
            x, grad = torch.randn(shape), torch.randn(shape)
            assert torch.equal(keyed_before(x, keys, 0, P), keyed(x))   # the same masks, the same outputs
            xg = x.clone().requires_grad_()
            for label, runs in [("forward", [(n, lambda f=f: f(x)) for n, f in fns]),
                                ("forward + backward", [(n, with_backward(f, xg, grad)) for n, f in fns])]:
                ratios, plain_ms = paired_ratios(runs, args.rounds)
                print(f"| {list(shape)} | {label} | {plain_ms:.3f} ms | {ratios['before']:.1f}x "
                      f"| {ratios['after']:.1f}x |")
        print("\nbytes autograd saves per element (for backward):")
        for name, fn in fns:
            print(f"  {name}: {saved_bytes_per_element(fn, SHAPES[-1]):g}")


if __name__ == "__main__":
    main()
