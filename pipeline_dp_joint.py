"""Data + pipeline parallelism: D pipelines of P stages on a 2-D grid of ranks, trained as one model.

The lesson: a pipeline is a row of the grid, the ranks that hold the same stage are a column.
Each pipeline takes its own contiguous slice of every global batch and runs a schedule of
pipeline_microbatch.py on it (imported, not copied); after its last backward, each stage averages
its gradients with the same stage of the other pipelines (one flattened all-reduce in its column's
process group), then every rank steps its optimizer. The default is 2 pipelines
x 3 stages, each stage working through 3 sequential microbatches.

What this adds to pipeline_microbatch.py (itself the baseline plus a pipeline): the Grid of ranks
and its row and column process groups, and the three data-parallel hooks of DataParallelReplicas
(slice the batch, average the gradients, average the logged loss).

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
import torch
import torch.distributed as dist

from mp.buckets import GradBuckets
from mp.check import report_replicas
from mp.clipping import clip_global
from mp.data import agree_on_data, dp_slice, load_data
from mp.dist import all_reduce_flat, awaiting, distributed, exit_now, group_timeout, torchrun_env
from mp.errors import fail, note_one_rank, stop_on_interrupt
from mp.flags import base_parser, validate_common
from mp.loop import train
from mp.optim import make_optimizer
from mp.pp.flags import add_pipeline_flags, validate_pipeline, validate_zero
from mp.pp.training import pipeline_check, pipeline_job
from mp.zero import ZeroOptimizer
from pipeline_microbatch import PipelineRank, setup_stage, train_step   # one pipeline, composed

PROGRAM = "pipeline_dp_joint"


def parse_args(argv=None):
    p = add_pipeline_flags(base_parser(__doc__))
    p.add_argument("--dp", type=int, default=2, help="data-parallel pipelines; stages = world size / dp")
    p.add_argument("--timeline", default=None, help="replica 0's measured schedule of the last step")
    p.set_defaults(microbatches=3, batch_size=72)   # 72 = 2 pipelines x 3 microbatches x 12 samples
    p.epilog = ("Defaults that differ from pipeline_microbatch.py's: --microbatches 3 (not 4) and\n"
                "--batch-size 72 (not 64), so that 2 pipelines x 3 microbatches divide the batch.")
    args = p.parse_args(argv)
    validate_common(args, PROGRAM)
    world = torchrun_env("gloo").world_size
    if args.dp <= 0 or world % args.dp:
        fixes = [f"--dp {d}" for d in range(2, world + 1) if world % d == 0][:2]
        if args.dp > 0:
            n = args.dp * 3
            fixes.append(f"{n} ranks (torchrun --nproc-per-node {n}: {args.dp} pipelines of 3 stages)")
        fail(f"the world size {world} is not divisible by --dp {args.dp}: launch dp x stages processes; "
             f"use {' or '.join(fixes)}")
    validate_pipeline(args, stages=world // args.dp, replicas=args.dp)
    validate_zero(args, args.dp)
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

    def pipeline(self, virtual):
        """My place in my pipeline, its peers addressed by global rank."""
        return PipelineRank(self.pp_rank, self.pp_size, self.ranks[self.dp_rank].tolist(), virtual, self.pp_group)


class DataParallelReplicas:
    """The data-parallel hooks of a pipeline's step (mp.pp.training): slice the batch, average the
    gradients and the logged loss over my column of the grid. zero: --zero 1 (mp.zero)."""

    def __init__(self, grid, timeout_s, runner, zero=False, late=()):
        self.dp_rank, self.dp_size, self.group, self.zero = grid.dp_rank, grid.dp_size, grid.dp_group, zero
        self.waiting = (f"stage {grid.pp_rank} of pipeline {grid.dp_rank} waited for the all-reduce with its "
                        f"data-parallel group, ranks {grid.dp_peers}", timeout_s)
        self.tp_rank = grid.tp_rank    # the loss is logged by tp rank 0 of replica 0's last stage
        # the gradients as views into flat buckets, each all-reduced as soon as the last microbatch's
        # backward has finished it (mp.buckets); 2bw steps its two weight versions in turn, so its
        # gradients are averaged after the backward instead, in one flat all-reduce
        self.buckets = None if runner.versions else GradBuckets(runner.parameters(), self.group, self.waiting,
                                                                shard=zero, recorder=runner, late=late)

    def slice(self, tensor):
        return dp_slice(tensor, self.dp_rank, self.dp_size)     # contiguous: the slices tile the batch

    def zero_grad(self, optimizer):
        if self.buckets:
            self.buckets.zero_grad()
        elif optimizer is not None:
            optimizer.zero_grad(set_to_none=True)

    def sync_grads(self, params):
        """The batch-mean gradient: each replica's gradient is its slice's mean, so the average of
        the D of them: all-reduced (summed) bucket by bucket during the backward, then divided by D.
        --zero 1: reduce-scattered instead, each replica getting the mean of its slice only."""
        if self.buckets:
            self.buckets.wait(before=self.before_average)
            return
        self.before_average()
        if self.dp_size > 1:
            with awaiting(*self.waiting):
                all_reduce_flat([p.grad for p in params], self.group, divide_by=self.dp_size)

    def before_average(self):
        """The sums that complete some gradients before they are averaged (parallel_3d.py's tp replicas)."""

    def clip(self, params, max_norm, groups, counted):
        """The global norm, and clipping; --zero 1: over the slices (the replicas' squares summed too)."""
        if not self.zero:
            return clip_global(params, max_norm, groups, counted)
        return clip_global(self.optimizer.slices, max_norm, self.norm_groups(groups), squares=self.optimizer.squares(counted))

    def norm_groups(self, groups):
        return list(groups) + [self.group] if self.zero else groups

    def average(self, losses):
        """The batch mean of the logged steps: each last stage holds its slice's mean loss; average over
        the column (one all-reduce for all the steps being logged; nccl reduces GPU tensors only: they are)."""
        with awaiting(*self.waiting):
            dist.all_reduce(losses, group=self.group)
        return losses / self.dp_size

    def make_optimizer(self, params, args):
        """torch's optimizer over my parameters; --zero 1: over my slices of the buckets (mp.zero)."""
        self.optimizer = ZeroOptimizer(self.buckets, args) if self.zero else make_optimizer(params, args)
        return self.optimizer


# ----------------------------------------------------------------------------- training


def main(argv=None):
    stop_on_interrupt()      # Ctrl-C: exit 130 with one line, no traceback (mp/errors.py)
    args = parse_args(argv)
    note_one_rank("one replica of a one-stage pipeline")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        grid = Grid(env.rank, env.world_size, args.dp, timeout=group_timeout(env, args.timeout_s))
        if env.rank == 0:
            print(f"grid (rows: pipelines, columns: data-parallel groups of one stage):\n{grid.ranks}", flush=True)
        pos = grid.pipeline(args.virtual_stages)      # 1 outside interleaved (validate_pipeline)
        model, runner = setup_stage(args, env, pos)   # 2bw: every pipeline runs it on its slice
        replicas = DataParallelReplicas(grid, args.timeout_s, runner, zero=args.zero == 1)
        if args.check:   # each replica checks its slice of the first batch
            status = pipeline_check(env, args, model, runner, data, train_step, replicas)
        else:
            status = train(args, env, pipeline_job(args, env, pos, model, runner, data, train_step, replicas, PROGRAM))
            same = report_replicas(list(model.parameters()), grid.dp_group, "parameters bit-identical across the "
                                   f"{grid.dp_size} replicas of every stage", env, args.timeout_s)
            status = status or same
    exit_now(status)


if __name__ == "__main__":
    main()
