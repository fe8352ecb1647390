"""The 3-D grid's costs: bytes per step on each axis (counted on a real run, next to the formula) and
step time against the joint grid, tensor parallelism and the baseline on the same global batch.

    python benchmarks/bench_3d.py --out logs/bench_3d            # prints the tables of docs/parallel_3d.md

Traffic: parallel_3d.py runs under torchrun with torch.distributed's all_reduce, all_gather and
batch_isend_irecv wrapped (`traffic` mode, one worker per rank): during train() each rank adds up
the bytes it hands to each collective or sends, by the axis of the group (the grid coordinate in
which the group's ranks differ; a group of one rank moves nothing and counts on no axis). Payload
per rank: an all-reduce of M bytes, the shard given to an all-gather, the shard a reduce-scatter
keeps, the message sent. A ring all-reduce puts 2(p-1)/p M on the wire per rank, an all-gather and
a reduce-scatter (p-1) x shard: at p = 2 these equal the payload. cnn_formula, vit_formula and
mlp_formula are the same sums done by hand, with and without --sequence-parallel and --scatter-gather.
"""
import argparse
import json
import os
import subprocess
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mp.flags import OneLineParser  # noqa: E402
FLOAT = 4   # bytes per float32


def axis_of(ranks, dp, tp, world):
    """'dp', 'pp' or 'tp': the coordinate of arange(world).view(dp, pp, tp) in which the ranks differ."""
    if len(ranks) == world:
        return "world"
    if len(ranks) == 1:      # an axis of size 1 (--dp 1): its "collectives" move nothing
        return "self"
    pp = world // (dp * tp)
    coords = [(r // (pp * tp), r // tp % pp, r % tp) for r in ranks]
    return next(name for i, name in enumerate(("dp", "pp", "tp")) if len({c[i] for c in coords}) > 1)


def traffic_worker(argv):
    """Run parallel_3d.main(argv) on this rank with the collectives counted during train(), up to its
    comparison of the replicas after the last step."""
    import torch.distributed as dist

    from mp import loop
    from mp.dist import exit_now
    from mp.tp import collectives
    import parallel_3d
    args = parallel_3d.parse_args(argv)
    world, counts, counting = int(os.environ["WORLD_SIZE"]), Counter(), [False]

    def tally(fn, kind):
        def wrapper(*a, **kw):
            if counting[0]:
                tensor = a[1] if kind == "all_gather" else a[0]   # all_gather(outputs, mine), reduce_scatter(mine, inputs)
                group = kw.get("group")
                ranks = dist.get_process_group_ranks(group) if group is not None else range(world)
                axis = axis_of(list(ranks), args.dp, args.tp, world)
                counts[f"{axis} {kind}"] += tensor.numel() * tensor.element_size()
            return fn(*a, **kw)
        return wrapper

    def batch(ops):
        if counting[0]:
            counts["pp send"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch_isend_irecv(ops)

    def train(*a, **kw):
        counting[0] = True
        try:
            return real_train(*a, **kw)
        finally:
            counting[0] = False

    def report_replicas(*a, **kw):   # the loop's comparison of the replicas after the run: not the steps' traffic
        counting[0] = False
        return real_report(*a, **kw)

    def leave(status):
        with open(os.path.join(os.environ["TRAFFIC_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(counts, f)
        real_exit(status)

    dist.all_reduce, dist.all_gather = tally(dist.all_reduce, "all_reduce"), tally(dist.all_gather, "all_gather")
    dist.reduce_scatter = tally(dist.reduce_scatter, "reduce_scatter")
    # tensor parallelism's flat-buffer gather and scatter, bound by mp.tp.collectives at import (their
    # arguments line up: a gather's a[1] and a scatter's a[0] are this rank's part)
    collectives.ALL_GATHER = tally(collectives.ALL_GATHER, "all_gather")
    collectives.REDUCE_SCATTER = tally(collectives.REDUCE_SCATTER, "reduce_scatter")
    batch_isend_irecv, dist.batch_isend_irecv = dist.batch_isend_irecv, batch
    assert callable(parallel_3d.train) and callable(parallel_3d.exit_now), "the names patched here moved"
    real_train, parallel_3d.train = parallel_3d.train, train
    real_report, loop.report_replicas = loop.report_replicas, report_replicas
    real_exit, parallel_3d.exit_now = exit_now, leave
    parallel_3d.main(argv)


def torchrun(nproc, argv, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--", *argv]
    run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{run.stderr[-3000:]}")


def cnn_formula(b, t):
    """Payload bytes per step of one rank of the cnn on 2 stages (blocks 0-2 | 3-4), b samples per replica,
    t tp ranks (t divides 6, 10 and 120), by axis and stage. Elements x 4 bytes."""
    tp = {0: b * (16 * 10 * 10 + 400),            # conv2's all-reduce (forward), f before fc1 (backward)
          1: b * (84 + 10 // t + 84)}              # fc2's all-reduce, fc3's gathered shard, f before fc3
    pp = {0: b * 120 // t, 1: b * 120 // t}        # fc1's shard forward, its gradient back
    params = {0: 6 // t * (75 + 1) + 16 * 6 // t * 25 + 16 + 32 + 120 // t * 401,   # conv1, conv2, norm, fc1
              1: 84 * 120 // t + 84 + 10 // t * 85}                             # fc2, fc3
    dp = {s: params[s] + (2 if s == 1 else 0) for s in (0, 1)}   # + the loss average (one float64) on stage 1
    norm = 2   # the gradient norm's sum of squares, one float64 summed over the tp and the pp group every step
    tp, pp = ({s: n + norm for s, n in d.items()} for d in (tp, pp))
    return {axis: {s: n * FLOAT for s, n in d.items()} for axis, d in (("tp", tp), ("pp", pp), ("dp", dp))}


def two_stages(n_blocks):
    """The blocks of stage 0 and stage 1 (pipeline_microbatch.partition: the first one larger)."""
    first = (n_blocks + 1) // 2
    return range(first), range(first, n_blocks)


def vit_formula(b, t, hidden, layers, dp=1, sequence_parallel=False, scatter_gather=True):
    """Payload bytes per step of one rank of the vit (tokens S = 64) on 2 stages, b samples per replica
    (tp divides hidden, heads and 64). A = b x 64 x hidden elements: the residual stream."""
    H, A = hidden, b * 64 * hidden
    stages = two_stages(layers + 2)
    blocks = {s: sum(0 < i <= layers for i in stages[s]) for s in (0, 1)}   # transformer blocks per stage
    if sequence_parallel:
        # per block: all-gather before q,k,v and before mlp.0, reduce-scatter after proj and mlp.2 (A/t each),
        # and the same four swapped in backward; the partial gradients' sum once a step (embedding
        # conv + bias + position table 113H, per block ln1, ln2 and two row biases 6H, the head's LayerNorm
        # 2H); the head's all-reduce of the pooled shares [b, H]
        tp = {s: 8 * A // t * blocks[s] + 6 * H * blocks[s] for s in (0, 1)}
        tp[0] += 113 * H
        tp[1] += b * H + 2 * H
        pp = {s: A // t for s in (0, 1)}   # my tokens' shard, forward and its gradient back
    else:
        tp = {s: 4 * A * blocks[s] for s in (0, 1)}   # f (backward) and g (forward), before/after attention and mlp
        pp = {s: A // t if scatter_gather else A for s in (0, 1)}
        if scatter_gather:   # the receivers all-gather the t slices: stage 1 in forward, stage 0 in backward
            tp = {s: n + A // t for s, n in tp.items()}
    block = 6 * H * H // t + 5 * H // t + 6 * H   # q, k, v, mlp.0 column; proj, mlp.2 row (whole biases); 2 norms
    params = {s: block * blocks[s] for s in (0, 1)}
    params[0] += 113 * H               # patch conv, its bias, position table (replicated)
    params[1] += 12 * H + 10           # head LayerNorm and classifier (replicated)
    return with_norm_and_dp(tp, pp, params, dp)


def mlp_formula(b, t, hidden, dp=1, scatter_gather=True):
    """The mlp of 4 layers on 2 stages (blocks 0-1 | 2-3): column, row | column, row. The cut follows
    the row-parallel layer 1: whole on every tp rank, so scatter/gather applies."""
    H = hidden
    tp = {0: b * H, 1: b * H + b * 10}   # g after layer 1; f before layer 2 (backward) and g after layer 3
    pp = {s: b * H // t if scatter_gather else b * H for s in (0, 1)}
    if scatter_gather:
        tp = {s: n + b * H // t for s, n in tp.items()}
    params = {0: H // t * (3072 + 1) + H * H // t + H, 1: H // t * (H + 1) + 10 * H // t + 10}
    return with_norm_and_dp(tp, pp, params, dp)


def with_norm_and_dp(tp, pp, params, dp):
    """Add the gradient norm's float64 sum (over the tp and the pp group) and the data-parallel axis:
    the gradient all-reduce and the loss average (one float64, last stage); elements -> bytes."""
    norm = 2
    tp, pp = ({s: n + norm for s, n in d.items()} for d in (tp, pp))
    dp = {s: (params[s] + (2 if s == 1 else 0)) if dp > 1 else 0 for s in (0, 1)}
    return {axis: {s: n * FLOAT for s, n in d.items()} for axis, d in (("tp", tp), ("pp", pp), ("dp", dp))}


def counted(folder, rank, steps):
    """{axis: bytes per step} that a traffic worker of this rank counted."""
    with open(os.path.join(folder, f"rank{rank}.json")) as f:
        counts = json.load(f)
    return {axis: sum(v for k, v in counts.items() if k.startswith(axis + " ")) / steps for axis in ("tp", "pp", "dp")}


def traffic(out, batch, steps):
    """Counted bytes per step of every rank of a 2x2x2 cnn run, by axis, against cnn_formula."""
    folder = os.path.join(out, "traffic")
    os.makedirs(folder, exist_ok=True)
    args = ["--model", "cnn", "--data", "synthetic", "--eval-every", "0", "--batch-size", str(batch),
            "--steps", str(steps), "--dp", "2", "--tp", "2", "--log-file", os.path.join(out, "traffic.jsonl")]
    torchrun(8, [os.path.abspath(__file__), "traffic", *args], {"TRAFFIC_DIR": folder})
    formula = cnn_formula(batch // 2, 2)
    measured = {}   # (stage, axis) -> {bytes per step of each of the stage's 4 ranks}
    for rank in range(8):
        for axis, per_step in counted(folder, rank, steps).items():
            measured.setdefault((rank // 2 % 2, axis), set()).add(per_step)
    rows = ["| stage (ranks) | axis | formula (bytes/step/rank) | measured, each of the 4 ranks |",
            "| --- | --- | --- | --- |"]
    for (stage, axis), values in sorted(measured.items(), key=lambda kv: (kv[0][0], "tp pp dp".index(kv[0][1]))):
        ranks = [r for r in range(8) if r // 2 % 2 == stage]
        rows.append(f"| {stage} {ranks} | {axis} | {formula[axis][stage]:,} | "
                    f"{' / '.join(f'{v:,.0f}' for v in sorted(values))} |")
    return "\n".join(rows)


def step_times(out, batch, steps):
    """Median step time of the four ways to train the cnn on the same global batch."""
    runs = [("single_baseline.py", 1, []), ("tensor_parallel.py", 2, []),
            ("pipeline_dp_joint.py", 4, ["--dp", "2", "--microbatches", "4"]),
            ("parallel_3d.py", 8, ["--dp", "2", "--tp", "2", "--microbatches", "4"])]
    rows = ["| program | grid | ranks | median step (ms) |", "| --- | --- | --- | --- |"]
    grids = {"single_baseline.py": "1", "tensor_parallel.py": "tp 2", "pipeline_dp_joint.py": "dp 2 x pp 2",
             "parallel_3d.py": "dp 2 x pp 2 x tp 2"}
    for program, nproc, extra in runs:
        log = os.path.join(out, f"step_{program[:-3]}.jsonl")
        argv = [program, "--model", "cnn", "--data", "synthetic", "--eval-every", "0", "--batch-size", str(batch),
                "--steps", str(steps), "--log-file", log, *extra]
        if nproc == 1:
            subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, capture_output=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        else:
            torchrun(nproc, argv)
        with open(log) as f:
            summary = [json.loads(line) for line in f if '"summary"' in line][0]
        rows.append(f"| `{program}` | {grids[program]} | {nproc} | {summary['median_step_time_s'] * 1e3:.1f} |")
    return "\n".join(rows)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "traffic":
        return traffic_worker(sys.argv[2:])
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="logs/bench_3d")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    print(f"cores: {os.cpu_count()}\n")
    print(traffic(out, args.batch_size, 3) + "\n")
    print(step_times(out, args.batch_size, args.steps))


if __name__ == "__main__":
    main()
