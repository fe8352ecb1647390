"""What each block of a model costs, forward plus backward, and the split over stages that this
cost suggests: the numbers behind docs/questions.md's advice on balancing a pipeline.

    python benchmarks/block_costs.py                          # cnn and mlp, a microbatch of 16, 4 stages
    python benchmarks/block_costs.py --model mlp --layers 8 --stages 4 --microbatch 16

One process, one thread (as each pipeline rank runs). A block's time is the median over --repeat
runs of its forward and of the backward from a gradient of ones, with its input requiring grad as
on every stage but the first (block 0's input needs no gradient, as on stage 0). The suggested
split is one of consecutive blocks whose slowest stage costs least by these times (where several
tie, the one the search meets first); pipeline_microbatch.py's --balance takes it (e.g. 1,1,1,2).
The last column and line: the flops mp/pp/balance.py counts per block, and the split --balance auto
makes from them, costed by the times measured here.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp.pp.balance import best_split, block_flops, stage_max  # noqa: E402
from mp.sizes import split_sizes  # noqa: E402  (the even split)
from mp.flags import OneLineParser  # noqa: E402
from mp.models import build_model  # noqa: E402


def block_times(blocks, x, repeat):
    """[(forward ms, backward ms)] per block, each the median of `repeat` runs after one warm-up."""
    out = []
    for i, block in enumerate(blocks):
        x = x.detach().requires_grad_(i > 0)
        forwards, backwards = [], []
        for _ in range(repeat + 1):
            start = time.perf_counter()
            y = block(x)
            middle = time.perf_counter()
            y.backward(torch.ones_like(y))
            end = time.perf_counter()
            forwards.append(middle - start)
            backwards.append(end - middle)
        out.append((1000 * statistics.median(forwards[1:]), 1000 * statistics.median(backwards[1:])))
        x = y
    return out


def report(name, args, model_args):
    torch.manual_seed(0)
    blocks = list(build_model(model_args))
    times = block_times(blocks, torch.randn(args.microbatch, 3, 32, 32), args.repeat)
    params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    flops = block_flops(model_args)
    total = sum(f + b for f, b in times)
    print(f"\n{name}, a microbatch of {args.microbatch}, median of {args.repeat}:")
    print("| block | layers | parameters | forward ms | backward ms | share of F+B | share of counted flops |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, (block, (f, b), n, c) in enumerate(zip(blocks, times, params, flops)):
        layers = ", ".join(type(m).__name__ for m in block.children()) or type(block).__name__
        print(f"| {i} | {layers} | {n:,} | {f:.3f} | {b:.3f} | {(f + b) / total:.0%} | {c / sum(flops):.0%} |")
    costs = [f + b for f, b in times]
    if args.stages <= len(blocks):
        even = split_sizes(len(blocks), args.stages)
        slowest, split = best_split(costs, args.stages)
        auto = best_split(flops, args.stages)[1]
        print(f"{args.stages} stages: even split {','.join(map(str, even))} -> slowest stage "
              f"{stage_max(costs, even):.3f} ms; by these times {','.join(map(str, split))} -> {slowest:.3f} ms "
              f"(a stage's least possible is the largest block, {max(costs):.3f} ms); --balance auto "
              f"(counted flops) {','.join(map(str, auto))} -> {stage_max(costs, auto):.3f} ms by these times")


def main():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["cnn", "mlp", "vit", "both"], default="both", help="both: cnn and mlp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--microbatch", type=int, default=16, help="samples a block sees at once (64 / 4 microbatches)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(1)
    for model in (["cnn", "mlp"] if args.model == "both" else [args.model]):
        model_args = argparse.Namespace(model=model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                        seed=0, dropout=0.0)
        name = model if model == "cnn" else f"{model} --layers {args.layers} --hidden {args.hidden}"
        report(name, args, model_args)


if __name__ == "__main__":
    main()
