"""--this-machine: the rates of the machine the planner runs on, measured once and kept, and the step time
of this project's runs on it.

Two numbers, measured as the ranks work: a float32 matmul of a transformer layer's shape on one thread
(the programs run torch.set_num_threads(1)), in GFLOP/s; and gloo's all-reduce between two local processes,
in GB/s a rank sends (a ring's 2(n-1)/n of the tensor). They are kept in a small JSON file,
$XDG_CACHE_HOME/mp/this_machine.json (~/.cache/mp/ by default), with the core count they were measured on;
--remeasure measures again.

The step time of a run from its flags (mp.plan.project's per-rank shares): each rank's matmul FLOPs (forward
2 x weights x tokens plus attention's two s x s products, backward twice that, a forward more with
--recompute) at the GEMM rate; the pipeline schedule's bubble stretches the busiest rank's compute
(mp.pp.schedules.bubble_theory); the bytes each rank sends a step (the summary's sent_mb_per_step) at the
gloo rate. Ranks that outnumber the cores share them: the step is never shorter than all ranks' compute
divided by the cores, however the schedule overlaps it.
"""
import json
import math
import os
import time

from mp.plan.model import block_params, from_args
from mp.plan.project import counts, grid_of, microbatches, my_blocks, per_replica_samples
from mp.pp.schedules import bubble_theory

GEMM = (2048, 256, 512)    # [b s, h] x [h, 2h]: a vit microbatch's fc1 at --hidden 256
ALL_REDUCE_MB = 8          # large enough that gloo's per-call latency is a small part of the time


def cache_path():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mp", "this_machine.json")


def gemm_gflops(repeats=20):
    """One thread's float32 matmul rate, the best of a few timings (the others' load only slows it)."""
    import torch   # here, not at the top: planning without --this-machine needs no torch
    torch.set_num_threads(1)
    m, k, n = GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def _all_reduce_rank(rank, path, out, repeats):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    x = torch.ones(ALL_REDUCE_MB * 2**20 // 4)
    dist.all_reduce(x)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(sorted(times)[len(times) // 2], f)
    dist.destroy_process_group()


def gloo_gbps(repeats=10):
    """GB/s one rank sends in gloo's all-reduce between two local processes (the median call)."""
    import tempfile
    import torch.multiprocessing as torch_mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        torch_mp.spawn(_all_reduce_rank, args=(os.path.join(tmp, "rendezvous"), out, repeats), nprocs=2)
        with open(out) as f:
            seconds = json.load(f)
    return ALL_REDUCE_MB * 2**20 / seconds / 1e9      # a ring of 2 sends half twice: the whole tensor


def this_machine(remeasure=False):
    """{gemm_gflops, gloo_gbps, cores, measured}: from the cache, or measured now and kept there."""
    path = cache_path()
    if not remeasure and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    rates = {"gemm_gflops": round(gemm_gflops(), 2), "gloo_gbps": round(gloo_gbps(), 3),
             "cores": os.cpu_count(), "measured": time.strftime("%Y-%m-%d %H:%M")}
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


def step_seconds(program, args, world, rates):
    """Predicted seconds of one training step of `program` with these flags on `world` ranks here."""
    m, grid = from_args(args), grid_of(program, args, world)
    M, samples = microbatches(program, args), per_replica_samples(program, args, grid)
    tokens = m.tokens // grid.cp
    passes = 3 + (1 if getattr(args, "recompute", False) else 0)    # forward, backward twice, recompute
    rate = rates["gemm_gflops"] * 1e9
    compute = []
    for rank in range(world):
        _, p, _, _ = grid.coords(rank)
        blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
        # expert_parallel: my experts run every rank's rows for them, the same FLOPs as my tokens' (an even route)
        flops = sum(block_flops(m, i, samples, tokens, grid.tp) for i in blocks)
        compute.append(M * passes * flops / rate)
    bubble = bubble_theory(grid.pp, M, getattr(args, "virtual_stages", 1), getattr(args, "schedule", "gpipe")) \
        if grid.pp > 1 else 0
    critical = max(compute) / (1 - bubble)
    shared = sum(compute) / min(world, rates["cores"])
    sent = counts(program, args, world)["sent_mb_per_step"]
    comm = max(sum(ranks.get(str(r), 0) for ranks in sent.values()) for r in range(world)) * 2**20
    return max(critical, shared) + comm / (rates["gloo_gbps"] * 1e9)
