"""--this-machine's measurements (mp/plan/machine.py runs `python -m mp.plan.measure` in a python of its own, so
that planning needs no torch): one thread's matmul and TransformerBlock rates, and gloo between n processes.

    python -m mp.plan.measure --world 4 --rates     # prints {"gloo": {hop_s, gbps}, "gemm_gflops", "block_gflops"}
"""
import json
import math
import multiprocessing
import os
import tempfile
import time

import torch
import torch.distributed as dist

from mp.flags import OneLineParser
from mp.models import TransformerBlock

GEMM = (2048, 256, 512)    # [b s, h] x [h, 2h]: a vit microbatch's fc1 at --hidden 256
BLOCK = (8, 64, 256, 4)    # samples, tokens, hidden, heads: a vit block at --hidden 256 --batch-size 32 over 4
ALL_REDUCE_MB = 8          # large enough that gloo's per-call latency is a small part of the time
REPEATS = 10


def best_seconds(work, repeats=REPEATS):
    """The fastest of a few timings of work() after one warm-up: others' load on the cores only slows it."""
    work()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_gflops():
    """One thread's float32 matmul rate."""
    torch.set_num_threads(1)
    m, k, n = GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / best_seconds(lambda: a @ b, 2 * REPEATS) / 1e9


def block_gflops():
    """mp.models.TransformerBlock's forward and backward on one thread, in its matmul FLOPs a second."""
    torch.set_num_threads(1)
    samples, tokens, hidden, heads = BLOCK
    block = TransformerBlock(hidden, heads)
    x = torch.randn(samples, tokens, hidden, requires_grad=True)
    seconds = best_seconds(lambda: block(x).sum().backward())
    flops = 3 * samples * (2 * tokens * (4 * hidden * hidden + 2 * 2 * hidden * hidden) + 4 * tokens * tokens * hidden)
    return flops / seconds / 1e9


def _all_reduce_rank(rank, world, path, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    m, k, n = GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    medians = []
    for numel in (1, ALL_REDUCE_MB * 2**20 // 4):
        x = torch.ones(numel)
        dist.all_reduce(x)
        times = []
        for _ in range(REPEATS):
            a @ b       # a layer's work between two collectives, as in a run: the peers reach the call at their turn
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        medians.append(sorted(times)[len(times) // 2])   # the median call: the ranks' scheduling varies
    if rank == 0:
        queue.put(medians)
    dist.destroy_process_group()


def gloo_rates(world):
    """{hop_s, gbps} of gloo between `world` processes here, each computing between its calls: one message's
    time (a one-float all-reduce over its 2(n-1) ring hops), and GB/s a rank sends in an 8 MB all-reduce beyond
    that wait. Forked, torch already imported: seconds, not a spawn's import in each process."""
    torch.set_num_threads(1)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_all_reduce_rank, args=(r, world, os.path.join(tmp, "rendezvous"), queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        one, large = queue.get(timeout=120)
        for p in procs:
            p.join()
    sent = 2 * (world - 1) / world * ALL_REDUCE_MB * 2**20
    return {"hop_s": round(one / (2 * (world - 1)), 6), "gbps": round(sent / max(large - one, 1e-6) / 1e9, 3)}


def main(argv=None):
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo's rates between this many processes")
    parser.add_argument("--rates", action="store_true", help="also the matmul and TransformerBlock rates")
    args = parser.parse_args(argv)
    out = {"gloo": gloo_rates(max(args.world, 2))}
    if args.rates:
        out.update(gemm_gflops=round(gemm_gflops(), 2), block_gflops=round(block_gflops(), 2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
