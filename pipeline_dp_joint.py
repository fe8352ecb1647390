"""Data + pipeline parallelism: D pipelines of P stages on a 2-D grid of ranks, trained as one model.

The lesson: a pipeline is a row of the grid, the ranks that hold the same stage are a column.
Each pipeline takes its own contiguous slice of every global batch and runs a schedule of
pipeline_microbatch.py on it (imported, not copied); after its last backward, each stage averages
its gradients with the same stage of the other pipelines (one flattened all-reduce in its column's
process group), then every rank steps its optimizer. The default is 2 pipelines
x 3 stages, each stage working through 3 sequential microbatches.

What this adds to pipeline_microbatch.py (itself the baseline plus a pipeline): the Grid of ranks
and its row and column process groups, and in its train_step the replica's slice of the batch and
the gradients averaged over the column (in flat buckets during the backward, mp.buckets); the logged
loss is averaged over the column when the loop logs it (mp.loop.Sums).

    torchrun --standalone --nproc-per-node 6 -- pipeline_dp_joint.py --data synthetic
    torchrun --standalone --nproc-per-node 6 -- pipeline_dp_joint.py --data synthetic --check

The grid for 6 ranks: grid = arange(world).view(dp, pp), so rank = dp_rank * pp + pp_rank.

                  stage 0   stage 1   stage 2
    pipeline 0:   rank 0 -> rank 1 -> rank 2      a row: point-to-point, every microbatch
    pipeline 1:   rank 3 -> rank 4 -> rank 5
                    |         |         |
                 dp group  dp group  dp group     a column: one gradient all-reduce per step

A pipeline's ranks are consecutive, so torchrun puts a whole pipeline on one node when
--nproc-per-node is a multiple of the stage count: the chatty point-to-point traffic (activations
and gradients of every microbatch) stays inside the machine, and only the once-per-step gradient
all-reduce crosses nodes. Adding tensor parallelism makes a third, innermost axis
(arange(world).view(dp, pp, tp), parallel_3d.py, whose Grid adds it): the tp ranks of one
stage exchange activations inside every layer, so they belong on the fastest links of all.
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

from functools import partial

import torch
import torch.distributed as dist

from mp import checkpoint
from mp.buckets import GradBuckets
from mp.cli import joint_args
from mp.clipping import clip_global
from mp.data import agree_on_data, load_data
from mp.dist import all_reduce_flat, awaiting, distributed, exit_now, group_timeout, torchrun_env
from mp.errors import note_one_rank
from mp.loop import Job, Replicas, Sums, train
from mp.optim import make_optimizer, whole_params
from mp.param_shards import ParamShards, weights_by_block
from mp.pp.balance import resolve_balance
from mp.pp.evaluate import evaluate_pipeline
from mp.pp.schedules import placement_of, schedule_actions
from mp.pp.timeline import Timeline
from mp.pp.training import pipeline_check, stage_batch
from mp.zero import ZeroOptimizer
from pipeline_microbatch import PipelineRank, forward_backward, setup_stage   # one pipeline, composed

PROGRAM = "pipeline_dp_joint"


def parse_args(argv=None):
    args = joint_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    resolve_balance(args, stages=torchrun_env("gloo").world_size // args.dp)   # --balance auto
    checkpoint.validate(args)               # the checkpoint to resume from, if any: whole, and of this run
    return args


# ----------------------------------------------------------------------------- the grid


class Grid:
    """Who am I on the dp x pp grid, and the process group of each axis through me."""

    def __init__(self, rank, world, dp, timeout=None):
        self.ranks = torch.arange(world).view(dp, world // dp)   # print it: rows are pipelines
        self.dp_size, self.pp_size = self.ranks.shape
        self.dp_rank, self.pp_rank = divmod(rank, self.pp_size)
        self.tp_rank = 0                      # no tensor parallelism here (parallel_3d.py adds that axis)
        pipelines, columns = self.ranks.tolist(), self.ranks.T.tolist()
        # new_group is itself a collective over all ranks: every rank creates every group, in the same
        # order, even the groups it is not in; otherwise the creations pair up wrongly and hang.
        # timeout: the default group's (mp.dist.group_timeout); new_group's own default is 30 minutes,
        # so a rank waiting on a stopped peer in its data-parallel all-reduce would hang that long
        self.pp_group = [dist.new_group(ranks, timeout=timeout) for ranks in pipelines][self.dp_rank]
        self.dp_group = [dist.new_group(ranks, timeout=timeout) for ranks in columns][self.pp_rank]
        self.dp_peers = columns[self.pp_rank]  # my stage's replicas: the gradient all-reduce's ranks

    def pipeline(self, virtual, placement="loop"):
        """My place in my pipeline, its peers addressed by global rank (placement: zbv's V, or the loop)."""
        return PipelineRank(self.pp_rank, self.pp_size, self.ranks[self.dp_rank].tolist(), virtual, self.pp_group,
                            placement)


def data_parallel_buckets(model, runner, grid, args, late=()):
    """The gradients as views into flat buckets (mp.buckets), each all-reduced (--zero 1, 2, 3: reduce-
    scattered) over my column of the grid as soon as its own gradients are final, so that it overlaps
    the backward of the layers before it (--zero 2, 3: in every microbatch's backward, the whole bucket
    let go after it); --zero 3: a bucket per block, whose weights mp.param_shards gathers and frees.
    Returns (the buckets, the shards of the weights under --zero 3, else None). The buckets are None
    under 2bw, which steps its two weight versions in turn: its gradients are averaged after the
    backward instead, in one flat all-reduce."""
    if runner.versions:
        return None, None
    direct = [w for stash in runner.stashes or [] for w in stash.weights]   # zb's W writes these in place itself
    grads = GradBuckets(runner.parameters(), grid.dp_group, waiting(grid, args), shard=args.zero >= 1,
                        recorder=runner, late=late, direct=direct, free=args.zero >= 2,
                        groups=weights_by_block(runner.chunks) if args.zero == 3 else None)
    grads.name_params(model.named_parameters())   # for its error lines
    model.grad_buckets = grads            # the summary reports what they sent per step (mp.loop)
    shards = ParamShards(runner.chunks, grads, args.zero3_gather) if args.zero == 3 else None
    return grads, shards


def waiting(grid, args):
    """What a wait on my data-parallel group says when it gives up (mp.dist.awaiting's arguments)."""
    return (f"stage {grid.pp_rank} of pipeline {grid.dp_rank} waited for the all-reduce with its data-parallel "
            f"group, ranks {grid.dp_peers}", args.timeout_s)


def train_step(step, runner, optimizer, actions, data, args, grid, grads, timeline, shards=None):
    """One optimizer step of D pipelines, in the order it runs; pipeline_microbatch.train_step with
    the replicas' slice of the batch and their gradient average. The loss (my slice's mean, on the
    last stages) is averaged over the replicas when the loop logs it (Sums), not in the step.
    shards (--zero 3): each block's weights are all-gathered by the block's own hooks as it runs."""
    timeline.begin(step)
    samples = args.batch_size // grid.dp_size     # my replica's contiguous slice of the global batch
    x, y = stage_batch(data, step, args, runner, runner.messenger.device, (grid.dp_rank, grid.dp_size))
    if grads:
        grads.zero_grad()                 # the buckets zeroed, each .grad a view into its bucket again
                                          # (--zero 2, 3: made as the backward's gradients arrive)
    else:
        optimizer.zero_grad(set_to_none=True)
    if runner.versions:                   # 2bw: its first step warms up, its last drains
        actions = runner.versions.actions(step)
    with runner.keys.training(step):      # buckets start during the backward, as the executor says
        loss = forward_backward(runner, actions, x, y, args.microbatches, samples, grid.dp_rank * samples, grads=grads)
    if shards:
        shards.release()                  # --zero 3: the whole weights gathered for this step go
    # data parallelism: each replica's gradient is its slice's mean; the batch's is their average
    if grads:
        grads.wait()                      # every bucket's all-reduce (or reduce-scatter), then / D
    elif grid.dp_size > 1:                # 2bw: one flat all-reduce after the backward
        with awaiting(*waiting(grid, args)):
            all_reduce_flat([p.grad for p in runner.parameters()], grid.dp_group, divide_by=grid.dp_size)
    with awaiting(f"rank {dist.get_rank()} waited for the gradient norm's sums of step {step}", args.timeout_s):
        norm = clip(runner, optimizer, args, grid)
    runner.update(optimizer)              # --zero 1, 2: my slices, then the all-gather (3: my slices only);
                                          # 2bw: the versions swap
    timeline.end(step)
    return loss, norm


def clip(runner, optimizer, args, grid):
    """The global gradient norm, and clipping (mp.clipping): over the stages (and parallel_3d.py's tp
    shards); --zero 1, 2, 3: each replica holds the mean gradient of its slices only, so over the slices,
    the replicas' squares summed too."""
    if not args.zero:
        return clip_global(runner.parameters(), args.clip_grad_norm, runner.norm_groups, runner.counted)
    return clip_global(optimizer.slices, args.clip_grad_norm, runner.norm_groups + [grid.dp_group],
                       squares=optimizer.squares(runner.counted))


def train_job(args, env, grid, runner, model, data, grads, shards, program, step=train_step):
    """The loop's Job for D pipelines: the step (this file's, or parallel_3d.py's), the optimizer
    (--zero 1, 2, 3: mp.zero's, over my slices of the buckets), my layout, who logs."""
    optimizer = ZeroOptimizer(grads, args, shards) if args.zero else make_optimizer(runner.parameters(), args)
    # the same every step (zbv on gloo: its sends right after their compute, mp.pp.p2p)
    actions = schedule_actions(args.schedule, runner.pos, args.microbatches,
                               sends_at_once=runner.messenger.sends_at_once)
    owner = runner.pos.is_last_stage and grid.dp_rank == 0 and grid.tp_rank == 0   # logs the loss
    timeline = Timeline(args, runner, runner.pos, owner)
    tp = env.world_size // (grid.dp_size * grid.pp_size)   # parallel_3d.py's third axis, else 1
    layout = checkpoint.layout_of(program, env, dp=grid.dp_size, pp=grid.pp_size, tp=tp, schedule=args.schedule,
                                  virtual_stages=runner.pos.virtual)
    return timeline, Job(
        partial(step, runner=runner, optimizer=optimizer, actions=actions, data=data, args=args, grid=grid,
                grads=grads, timeline=timeline, shards=shards),
        model, optimizer, layout, owner,
        evaluate=partial(evaluate_replica, runner, grid, data, env, optimizer),
        # logged: the replicas' losses averaged; the norm's squares summed as clip() sums them
        sums=Sums(replicas=grid.dp_group, norm_groups=runner.norm_groups + ([grid.dp_group] if args.zero else [])),
        versions=runner.versions.weights if runner.versions else None,
        # after the run: the replicas of every stage bit-identical (under --zero the same bytes by
        # construction: nothing to gather or compare, and the line says so)
        replicas=[Replicas(list(model.parameters()), grid.dp_group, "parameters bit-identical across the "
                           f"{grid.dp_size} replicas of every stage", args.zero)])


def evaluate_replica(runner, grid, data, env, optimizer):
    """Replica 0's pipeline evaluates (the others hold the same weights). --zero 3: every replica takes
    part in gathering the weights whole first (whole_params: collectives over the replicas)."""
    with whole_params(optimizer):
        return evaluate_pipeline(runner, runner.pos, data, env.device) if grid.dp_rank == 0 else None


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("one replica of a one-stage pipeline")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        grid = Grid(env.rank, env.world_size, args.dp, timeout=group_timeout(env, args.timeout_s))
        if env.rank == 0:
            print(f"grid (rows: pipelines, columns: data-parallel groups of one stage):\n{grid.ranks}", flush=True)
        pos = grid.pipeline(args.virtual_stages, placement_of(args.schedule))   # 1 outside interleaved and zbv
        model, runner = setup_stage(args, env, pos)   # 2bw: every pipeline runs it on its slice
        grads, shards = data_parallel_buckets(model, runner, grid, args)
        if args.check:   # each replica checks its slice of the first batch
            status = pipeline_check(env, args, model, runner, data, forward_backward, (grid.dp_rank, grid.dp_size),
                                    grads)
        else:
            timeline, job = train_job(args, env, grid, runner, model, data, grads, shards, PROGRAM)
            status = train(args, env, job)   # the loop (mp/loop.py), then the replicas compared
            timeline.write()
    exit_now(status)


if __name__ == "__main__":
    main()
