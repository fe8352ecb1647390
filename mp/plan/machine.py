"""--this-machine: the rates of the machine the planner runs on, measured once and kept, and the step time
of this project's runs on it.

Measured as the ranks work, one thread a process (the programs run torch.set_num_threads(1)):
  gemm_gflops   a float32 matmul of a transformer layer's shape, GFLOP/s (for reference: the step uses the next);
  block_gflops  mp.models' own TransformerBlock, forward and backward at --hidden 256, 64 tokens, 8 samples, in
                its counted matmul FLOPs a second: LayerNorm, GELU, softmax, the adds and autograd's own work
                make it a half to two thirds of the GEMM rate here; a step's blocks are charged at it;
  gloo[n]       n processes on this machine's cores, each running a GEMM between its calls as a run's ranks
                compute between theirs (n: the run's world size, measured the first time it is asked for):
                a one-float all-reduce's time over the ring's 2(n-1) hops (one message between two ranks, mostly
                the wait for the peer's turn on a core when ranks outnumber the cores), and GB/s a rank sends in
                an 8 MB all-reduce beyond that wait (2(n-1)/n of the tensor).
They are kept in a small JSON file, $XDG_CACHE_HOME/mp/this_machine.json (~/.cache/mp/ by default), with the
core count they were measured on; --remeasure measures again.

The step time of a run from its flags (mp.plan.project's per-rank shares): each rank's compute is its blocks'
matmul FLOPs (forward 2 x weights x tokens plus attention's two s x s products, backward twice that, a forward
more with --recompute) at the block rate. A pipeline's critical path is one microbatch through every stage and
M - 1 more at the slowest stage's pace (other schedules: mp.pp.schedules.bubble_theory's bubble); ranks that
outnumber the cores share them, so the compute part of a step is never shorter than all ranks' compute over the
cores, however the schedule overlaps it. To that the busiest rank's communication is added: its messages a step
(p2p sends, collective calls counted in ring hops) at the hop time, and the bytes it sends (the summary's
sent_mb_per_step) at the gloo rate, both of the run's world size.
"""
import json
import math
import multiprocessing
import os
import time

from mp.plan.model import block_params, from_args
from mp.plan.buckets import bucket_numels
from mp.plan.project import (block_sizes, chunk_blocks, counts, grid_of, microbatches, my_blocks, per_replica_samples,
                             program_of, rank_params, transformer_layers)
from mp.pp.schedules import bubble_theory, stage_owner, virtual_stage

GEMM = (2048, 256, 512)    # [b s, h] x [h, 2h]: a vit microbatch's fc1 at --hidden 256
BLOCK = (8, 64, 256, 4)    # samples, tokens, hidden, heads: a vit block at --hidden 256 --batch-size 32 over 4
ALL_REDUCE_MB = 8          # large enough that gloo's per-call latency is a small part of the time
REPEATS = 10


def cache_path():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mp", "this_machine.json")


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
    import torch   # here, not at the top: planning without --this-machine needs no torch
    torch.set_num_threads(1)
    m, k, n = GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / best_seconds(lambda: a @ b, 2 * REPEATS) / 1e9


def block_gflops():
    """mp.models.TransformerBlock's forward and backward on one thread, in its matmul FLOPs a second."""
    import torch
    from mp.models import TransformerBlock
    torch.set_num_threads(1)
    samples, tokens, hidden, heads = BLOCK
    block = TransformerBlock(hidden, heads)
    x = torch.randn(samples, tokens, hidden, requires_grad=True)
    seconds = best_seconds(lambda: block(x).sum().backward())
    flops = 3 * samples * (2 * tokens * (4 * hidden * hidden + 2 * 2 * hidden * hidden) + 4 * tokens * tokens * hidden)
    return flops / seconds / 1e9


def _all_reduce_rank(rank, world, path, queue):
    import torch
    import torch.distributed as dist
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
    import tempfile
    import torch   # imported before the fork, so the children start with it
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


def this_machine(remeasure=False, world=2):
    """{gemm_gflops, block_gflops, gloo: {world: {hop_s, gbps}}, cores, measured}: from the cache, measured now
    where missing (a world size not seen before adds its gloo rates) and kept there."""
    path = cache_path()
    rates = {}
    if not remeasure and os.path.exists(path):
        with open(path) as f:
            rates = json.load(f)
    if "block_gflops" not in rates:      # a cache of an older planner lacks it: measure it all again
        rates = {"gemm_gflops": round(gemm_gflops(), 2), "block_gflops": round(block_gflops(), 2), "gloo": {},
                 "cores": os.cpu_count(), "measured": time.strftime("%Y-%m-%d %H:%M")}
    world = max(world, 2)
    if str(world) in rates["gloo"]:
        return rates
    rates["gloo"][str(world)] = gloo_rates(world)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rates, f)
    return rates


def block_flops(m, i, samples, tokens, tp):
    """Forward matmul FLOPs of block i for one microbatch on a tp rank: 2 x weights x tokens, plus the
    attention's q k^T and p v (2 x 2 x s^2 x h a sample over the tp ranks' heads)."""
    weights = sum(q.numel(tp) for q in block_params(m, i, tp) if len(q.shape) > 1 and q.expert is None)
    if m.experts:    # each token runs top_k experts of one expert's size
        expert = [q for q in block_params(m, i, tp) if q.expert == 0 and len(q.shape) > 1]
        weights += m.top_k * sum(q.numel() for q in expert)
    attention = 4 * tokens * tokens * m.hidden // tp if 0 < i < m.blocks() - 1 else 0
    return samples * (2 * weights * tokens + attention)


GATHER_HOPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: 2 * (n - 1),   # gloo's: in place
               "all_gather": lambda n: n}                                     # gloo's: n broadcasts


def dp_hops(m, grid, rank, args):
    """Ring hops of my data-parallel gradient sync a step: each bucket's collectives (mp.plan.project's
    bucket_traffic), or the one flat all-reduce of context_parallel and expert_parallel."""
    n = {"dp": grid.dp, "dp_cp": grid.dp * grid.cp, "cp": grid.cp, "ep": grid.ep}.get(grid.dense_sync, 1)
    if n == 1:
        return 0
    if grid.flat:
        return 2 * (n - 1)
    zero, M = getattr(args, "zero", 0), microbatches(program_of(args), args)
    dense, _ = rank_params(m, grid, rank, args)
    blocks = block_sizes(m, grid, rank, args) if zero == 3 else None
    buckets = len(bucket_numels(dense, zero, getattr(args, "bucket_mb", None), blocks))
    gathers = 2 * M if getattr(args, "zero3_gather", None) == "microbatch" else 1
    ops = {0: [("all_reduce", 1)], 1: [("reduce_scatter", 1), ("all_gather", 1)],
           2: [("reduce_scatter", M), ("all_gather", 1)], 3: [("reduce_scatter", M), ("all_gather", gathers)]}[zero]
    return buckets * sum(times * GATHER_HOPS[op](n) for op, times in ops)


def hops(program, args, m, grid, rank):
    """Messages my rank waits on a step, counted as ring hops: its pipeline sends (one a microbatch across each
    cut it borders), tp's all-reduces (four a layer a microbatch, 2(t-1) hops each), the ring's K, V passes or
    Ulysses' all-to-alls of cp, and the data-parallel sync."""
    M, (_, p, _, _) = microbatches(program, args), grid.coords(rank)
    blocks, layers = transformer_layers(m, grid, rank, args)
    n = dp_hops(m, grid, rank, args)
    if grid.pp > 1 or getattr(args, "virtual_stages", 1) > 1:
        last = len(chunk_blocks(args, m, grid.pp)) - 1
        placement = "v" if getattr(args, "schedule", "") == "zbv" else "loop"
        for c in range(getattr(args, "virtual_stages", 1)):
            v = virtual_stage(c, p, grid.pp, placement)
            n += M * sum(1 for w in (v - 1, v + 1) if 0 <= w <= last and stage_owner(w, grid.pp, placement)[0] != p)
    if grid.tp > 1:
        n += M * layers * (4 + 2 * bool(getattr(args, "recompute", False))) * 2 * (grid.tp - 1)
    if grid.cp > 1:
        c = grid.cp
        per_layer = 3 * c - 2 if getattr(args, "attention", "ring") == "ring" else 8 * (c - 1)
        n += M * layers * per_layer
    return n


def pipeline_seconds(args, grid, M, compute):
    """The busiest pipeline's compute with unlimited cores. GPipe and 1F1B: one microbatch through every stage
    (the fill and the drain), then M - 1 more at the slowest stage's pace, which uneven stages (6 blocks on 4
    stages: 2, 2, 1, 1) make longer than the balanced bubble says; the other schedules: their bubble."""
    if grid.pp == 1:
        return max(compute)
    schedule, v = getattr(args, "schedule", "gpipe"), getattr(args, "virtual_stages", 1)
    if schedule in ("gpipe", "1f1b") and v == 1:
        stages = [max(compute[r] for r in range(grid.world) if grid.coords(r)[1] == p) / M for p in range(grid.pp)]
        return sum(stages) + (M - 1) * max(stages)
    return max(compute) / (1 - bubble_theory(grid.pp, M, v, schedule))


def step_seconds(program, args, world, rates):
    """Predicted seconds of one training step of `program` with these flags on `world` ranks here."""
    m, grid = from_args(args), grid_of(program, args, world)
    M, samples = microbatches(program, args), per_replica_samples(program, args, grid)
    tokens = m.tokens // grid.cp
    args.program = program
    passes = 3 + (1 if getattr(args, "recompute", False) else 0)    # forward, backward twice, recompute
    rate = rates["block_gflops"] * 1e9
    compute = []
    for rank in range(world):
        _, p, _, _ = grid.coords(rank)
        blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
        # expert_parallel: my experts run every rank's rows for them, the same FLOPs as my tokens' (an even route)
        flops = sum(block_flops(m, i, samples, tokens, grid.tp) for i in blocks)
        compute.append(M * passes * flops / rate)
    critical = pipeline_seconds(args, grid, M, compute)
    shared = sum(compute) / min(world, rates["cores"])
    if world == 1:
        return max(critical, shared)
    gloo = rates["gloo"][str(world)]
    sent = counts(program, args, world)["sent_mb_per_step"]
    comm = max(hops(program, args, m, grid, r) * gloo["hop_s"] +
               sum(ranks.get(str(r), 0) for ranks in sent.values()) * 2**20 / (gloo["gbps"] * 1e9)
               for r in range(world))
    return max(critical, shared) + comm
