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
(arange(world).view(dp, pp, tp), parallel_3d.py; Grid takes it here already): the tp ranks of one
stage exchange activations inside every layer, so they belong on the fastest links of all.
"""
import torch
import torch.distributed as dist

from common import (awaiting, base_parser, distributed, exit_now, fail, group_timeout, note_one_rank,
                    replicas_identical, torchrun_env, validate_common)
from data import agree_on_data, dp_slice, load_data
from pipeline_check import check_and_exit
from pipeline_flags import add_pipeline_flags, validate_pipeline
from pipeline_microbatch import PipelineRank, schedule_actions, setup_stage
from pipeline_train import train

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
    return args


# ----------------------------------------------------------------------------- the grid


class Grid:
    """Who am I on the dp x pp (x tp) grid, and the process group of each axis through me.
    This program's grid has tp = 1; parallel_3d.py adds the third, innermost axis."""

    AXES = ("dp", "pp", "tp")

    def __init__(self, rank, world, dp, tp=1, timeout=None):
        self.ranks = torch.arange(world).view(dp, world // (dp * tp), tp)   # print it: rows are pipelines
        self.dp_size, self.pp_size, self.tp_size = self.ranks.shape
        self.dp_rank, self.pp_rank, self.tp_rank = (self.ranks == rank).nonzero()[0].tolist()
        # new_group is itself a collective over all ranks: every rank creates every group of every
        # axis, in the same order, even the groups it is not in; otherwise the creations pair up wrongly and hang
        self.lines, groups = {}, {}
        for axis, name in enumerate(self.AXES):
            # the lines of the grid along this axis: the ranks that differ only in this coordinate
            self.lines[name] = self.ranks.movedim(axis, -1).reshape(-1, self.ranks.shape[axis]).tolist()
            # timeout: the default group's (common.group_timeout); new_group's own default is 30 minutes,
            # so a rank waiting on a stopped peer in its data-parallel all-reduce would hang that long
            made = [dist.new_group(line, timeout=timeout) for line in self.lines[name]]
            groups[name] = next(g for g, line in zip(made, self.lines[name]) if rank in line)
        self.dp_group, self.pp_group, self.tp_group = (groups[name] for name in self.AXES)

    def pipeline(self, virtual):
        """My place in my pipeline (my replica, my tp rank), its peers addressed by global rank."""
        peers = self.ranks[self.dp_rank, :, self.tp_rank].tolist()
        return PipelineRank(self.pp_rank, self.pp_size, peers, virtual, self.pp_group)


class DataParallelReplicas:
    """The hooks pipeline_microbatch.train() calls: slice the batch, average gradients and loss."""
    BUCKET_MB = 16

    def __init__(self, grid, timeout_s, device):
        self.dp_rank, self.dp_size, self.group, self.device = grid.dp_rank, grid.dp_size, grid.dp_group, device
        self.waiting = (f"stage {grid.pp_rank} of pipeline {grid.dp_rank} waited for the all-reduce with its "
                        f"data-parallel group, ranks {grid.ranks[:, grid.pp_rank, grid.tp_rank].tolist()}", timeout_s)
        self.tp_rank = grid.tp_rank    # train(): the loss is logged by tp rank 0 of replica 0's last stage

    def slice(self, tensor):
        return dp_slice(tensor, self.dp_rank, self.dp_size)     # contiguous: the slices tile the batch

    def sync_grads(self, params):
        """All gradients flattened into buckets of at most BUCKET_MB, one all-reduce each, then
        divided by D. Flattened: on gloo this measured about 4x faster than one all-reduce per
        parameter for the cnn (2.0 against 8.0 ms for 6 tensors, 2 ranks), since each collective
        pays a fixed round-trip cost. Bucketed: one flat copy of every gradient would cost as much
        memory again as the gradients themselves (DDP's buckets are 25 MB for the same reason)."""
        if self.dp_size == 1:
            return
        for bucket in buckets([p.grad for p in params], self.BUCKET_MB * 2**20):
            flat = torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0]   # one: in place
            with awaiting(*self.waiting):
                dist.all_reduce(flat, group=self.group)
            flat /= self.dp_size
            if len(bucket) > 1:
                for g, new in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(new.view_as(g))

    def average(self, loss):
        """The batch mean: each last stage holds its slice's mean loss; average over the column."""
        t = torch.tensor([loss], dtype=torch.float64, device=self.device)   # nccl reduces GPU tensors only
        with awaiting(*self.waiting):
            dist.all_reduce(t, group=self.group)
        return t.item() / self.dp_size


def buckets(tensors, max_bytes):
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor: a group of its own)."""
    groups, size = [[]], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups if groups[0] else []


def report_replicas(runner, grid, rank):
    """End of a run: every stage's parameters must be bit-identical across its data-parallel group
    (same start, same averaged gradient, same update). 0 if so, else 1."""
    same = replicas_identical([p for chunk in runner.chunks for p in chunk.parameters()], grid.dp_group)
    if rank == 0:
        print(f"parameters bit-identical across the {grid.dp_size} replicas of every stage: "
              f"{'yes' if same else 'NO'}", flush=True)
    return 0 if same else 1


# ----------------------------------------------------------------------------- training


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("one replica of a one-stage pipeline")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        grid = Grid(env.rank, env.world_size, args.dp, timeout=group_timeout(env, args.timeout_s))
        if env.rank == 0:
            grid_2d = grid.ranks[..., 0]                 # the tp axis has one rank here
            print(f"grid (rows: pipelines, columns: data-parallel groups of one stage):\n{grid_2d}", flush=True)
        pos = grid.pipeline(args.virtual_stages)      # 1 outside interleaved (validate_pipeline)
        model, runner = setup_stage(args, env, pos)
        actions = schedule_actions(args.schedule, pos, args.microbatches)
        if args.schedule == "2bw":   # every pipeline runs 2bw on its slice; the averaged gradient is the batch's
            actions = runner.step_actions(args.steps)
        replicas = DataParallelReplicas(grid, args.timeout_s, env.device)
        if args.check:
            x, y = data.batch(0, args.batch_size)
            status = check_and_exit(env, runner, actions, model, args, x.to(env.device), y.to(env.device),
                                    replica=(grid.dp_rank, grid.dp_size), sync_grads=replicas.sync_grads)
        else:
            status = train(args, env, pos, runner, actions, data, replicas, PROGRAM)
            status = status or report_replicas(runner, grid, env.rank)
    exit_now(status)


if __name__ == "__main__":
    main()
