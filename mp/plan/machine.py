"""--this-machine: the rates of the machine the planner runs on, measured once and kept, and the step time
of this project's runs on it.

Measured as the ranks work, one thread a process (the programs run torch.set_num_threads(1)), by mp/plan/measure.py
in a python of its own (planning needs no torch; measuring does):
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
import os
import subprocess
import sys
import time

from mp.plan.buckets import bucket_numels, bucket_ops
from mp.plan.model import block_params, from_args
from mp.plan.project import (block_sizes, chunk_blocks, counts, grid_of, microbatches, my_blocks, per_replica_samples,
                             program_of, rank_params, transformer_layers)
from mp.pp.schedules import bubble_theory, stage_owner, virtual_stage


def cache_path():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mp", "this_machine.json")


def measure(world, rates=True):
    """mp.plan.measure's numbers, in a python of its own (torch is needed to measure, not to plan): {gloo: the
    rates of `world` processes} and, with rates, {gemm_gflops, block_gflops}."""
    argv = [sys.executable, "-m", "mp.plan.measure", "--world", str(world)] + (["--rates"] if rates else [])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: measuring this machine ({' '.join(argv[1:])}) took over 300 s; try again when the "
                 "cores are less busy, or plan without --this-machine")
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"error: measuring this machine failed ({last}); --this-machine needs torch, as the programs do")
    return json.loads(done.stdout)


def this_machine(remeasure=False, world=2):
    """{gemm_gflops, block_gflops, gloo: {world: {hop_s, gbps}}, cores, measured}: from the cache, measured now
    where missing (a world size not seen before adds its gloo rates) and kept there."""
    path = cache_path()
    rates = {}
    if not remeasure and os.path.exists(path):
        with open(path) as f:
            rates = json.load(f)
    world = max(world, 2)
    if "block_gflops" in rates and str(world) in rates["gloo"]:
        return rates
    measured = measure(world, rates=("block_gflops" not in rates))   # an older planner's cache: all again
    if "block_gflops" not in rates:
        rates = {"gemm_gflops": measured["gemm_gflops"], "block_gflops": measured["block_gflops"], "gloo": {},
                 "cores": os.cpu_count(), "measured": time.strftime("%Y-%m-%d %H:%M")}
    rates["gloo"][str(world)] = measured["gloo"]
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
    n = grid.sync_size()
    if n == 1:
        return 0
    if grid.flat:
        return 2 * (n - 1)
    zero, M = getattr(args, "zero", 0), microbatches(program_of(args), args)
    dense, _ = rank_params(m, grid, rank, args)
    blocks = block_sizes(m, grid, rank, args) if zero == 3 else None
    buckets = len(bucket_numels(dense, zero, getattr(args, "bucket_mb", None), blocks))
    ops = bucket_ops(zero, M, getattr(args, "zero3_gather", None))
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
