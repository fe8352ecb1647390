"""Data + pipeline parallelism: D pipelines of P stages on a 2-D grid of ranks, trained as one model.

The lesson: a pipeline is a row of the grid, the ranks that hold the same stage are a column.
Each pipeline takes its own contiguous slice of every global batch and runs a schedule of
pipeline_microbatch.py on it (imported, not copied); after its last backward, each stage averages
its gradients with the same stage of the other pipelines (in its column's process group), then every
rank steps its optimizer. The default is 2 pipelines x 3 stages, each stage working through 3
sequential microbatches.

What this adds to pipeline_microbatch.py (itself the baseline plus a pipeline): the grid of ranks
(mp.mesh, the one layout every program takes its groups from: here its dp and pp axes) with its row and
column process groups, and in its train_step the replica's slice of the batch and the gradients averaged
over the column (in flat buckets during the backward, mp.buckets); the logged loss is averaged over the
column when the loop logs it (mp.loop.Sums).

    torchrun --standalone --nproc-per-node 6 -- pipeline_dp_joint.py --data synthetic
    torchrun --standalone --nproc-per-node 6 -- pipeline_dp_joint.py --data synthetic --check

The grid for 6 ranks: mesh.ranks = arange(world).view(dp, pp) (cp and tp of 1), so rank = dp_rank * pp + pp_rank.

                  stage 0   stage 1   stage 2
    pipeline 0:   rank 0 -> rank 1 -> rank 2      a row: point-to-point, every microbatch
    pipeline 1:   rank 3 -> rank 4 -> rank 5
                    |         |         |
                 dp group  dp group  dp group     a column: the gradient sync of the step

A pipeline's ranks are consecutive, so torchrun puts a whole pipeline on one node when
--nproc-per-node is a multiple of the stage count: the chatty point-to-point traffic (activations
and gradients of every microbatch) stays inside the machine, and only the gradient sync crosses nodes.
What that sync is, per bucket of gradients (mp.buckets) and step: --zero 0 one all-reduce, started in
the last microbatch's backward (2bw: one flat all-reduce after the backward); --zero 1 one reduce-scatter,
then an all-gather of the updated slices; --zero 2 a reduce-scatter in every microbatch's backward (M a
step), then the all-gather; --zero 3 the M reduce-scatters, and each block's weights all-gathered once a
step, or before every forward and every backward (2M) with --zero3-gather microbatch.
Adding tensor parallelism makes a third, innermost axis (arange(world).view(dp, pp, tp), parallel_3d.py):
the tp ranks of one stage exchange activations inside every layer, so they belong on the fastest links of
all (mp/mesh.py draws every axis).
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

from functools import partial

import torch.distributed as dist

from mp import checkpoint
from mp.buckets import GradBuckets
from mp.cli import joint_args
from mp.clipping import clip_global
from mp.data import agree_on_data, load_data
from mp.dist import all_reduce_flat, awaiting, distributed, exit_now, group_timeout, torchrun_env
from mp.errors import note_one_rank
from mp.loop import Job, Replicas, Sums, train
from mp.loss import loss_function
from mp.mesh import Mesh
from mp.optim import make_optimizer, runs_on_every_replica, whole_params
from mp.param_shards import ParamShards, weights_by_block
from mp.pp.balance import resolve_balance
from mp.pp.evaluate import evaluate_pipeline
from mp.pp.schedules import placement_of, schedule_actions
from mp.pp.tied import tie_embeddings, tied_replicas, tied_stages
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


# ----------------------------------------------------------------------------- the mesh's pipelines


def pipeline(mesh, virtual, placement="loop"):
    """My place in my pipeline: the mesh's pp line through me, its peers addressed by global rank, on
    the pp group (placement: zbv's V, or the loop). Here, not in mp/mesh.py: PipelineRank is
    pipeline_microbatch.py's, and the package never imports a program."""
    return PipelineRank(mesh.pp_rank, mesh.pp_size, mesh.peers("pp"), virtual, mesh.pp_group, placement)


def data_parallel_buckets(model, runner, mesh, args, late=()):
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
    grads = GradBuckets(runner.parameters(), mesh.dp_group, waiting(mesh, args), shard=args.zero >= 1,
                        bucket_mb=args.bucket_mb, recorder=runner, late=late, direct=direct, free=args.zero >= 2,
                        groups=weights_by_block(runner.chunks) if args.zero == 3 else None)
    grads.name_params(model.named_parameters())   # for its error lines
    model.grad_buckets = grads            # the summary reports what they sent per step (mp.loop)
    shards = ParamShards(runner.chunks, grads, args.zero3_gather) if args.zero == 3 else None
    return grads, shards


def waiting(mesh, args):
    """What a wait on my data-parallel group says when it gives up (mp.dist.awaiting's arguments)."""
    return (f"stage {mesh.pp_rank} of pipeline {mesh.dp_rank} waited for the all-reduce with its data-parallel "
            f"group, ranks {mesh.peers('dp')}", args.timeout_s)


def train_step(step, runner, optimizer, actions, data, args, mesh, grads, timeline, shards=None):
    """One optimizer step of D pipelines, in the order it runs; pipeline_microbatch.train_step with
    the replicas' slice of the batch and their gradient average. The loss (my slice's mean, on the
    last stages) is averaged over the replicas when the loop logs it (Sums), not in the step.
    shards (--zero 3): each block's weights are all-gathered by the block's own hooks as it runs."""
    timeline.begin(step)
    samples = args.batch_size // mesh.dp_size     # my replica's contiguous slice of the global batch
    x, y = stage_batch(data, step, args, runner, runner.messenger.device, (mesh.dp_rank, mesh.dp_size))
    if grads:
        grads.zero_grad(step)             # the buckets zeroed, each .grad a view into its bucket again
                                          # (--zero 2, 3: made as the backward's gradients arrive)
    else:
        optimizer.zero_grad(set_to_none=True)
    if runner.versions:                   # 2bw: its first step warms up, its last drains
        actions = runner.versions.actions(step)
    # the gpt: each microbatch's tokens over the global batch's valid-token count, times M x D, so that the
    # 1/M and the replicas' average leave each token weighing 1/N (mp.loss); a per-replica count would not
    loss_fn = loss_function(args, data, step, pieces=args.microbatches * mesh.dp_size)
    with runner.keys.training(step):      # buckets start during the backward, as the executor says
        loss = forward_backward(runner, actions, x, y, args.microbatches, samples, mesh.dp_rank * samples, grads=grads,
                                loss_fn=loss_fn)
    if shards:
        shards.release()                  # --zero 3: the whole weights gathered for this step go
    runner.tied.sum_grads()               # a tied gpt: its first and last stage's parts summed, once (mp.pp.tied)
    # data parallelism: each replica's gradient is its slice's mean; the batch's is their average
    if grads:
        grads.final_late()                # the tied weight's bucket starts only now, on the summed gradient
        grads.wait()                      # every bucket's all-reduce (or reduce-scatter), then / D
    elif mesh.dp_size > 1:                # 2bw: one flat all-reduce after the backward
        with awaiting(*waiting(mesh, args)):
            all_reduce_flat([p.grad for p in runner.parameters()], mesh.dp_group, divide_by=mesh.dp_size,
                            bucket_mb=args.bucket_mb or 16)
    with awaiting(f"rank {dist.get_rank()} waited for the gradient norm's sums of step {step}", args.timeout_s):
        norm = clip(runner, optimizer, args, mesh)
    runner.update(optimizer)              # --zero 1, 2: my slices, then the all-gather (3: my slices only);
                                          # 2bw: the versions swap
    timeline.end(step)
    return loss, norm


def clip(runner, optimizer, args, mesh):
    """The global gradient norm, and clipping (mp.clipping): over the stages (and parallel_3d.py's tp
    shards); --zero 1, 2, 3: each replica holds the mean gradient of its slices only, so over the slices,
    the replicas' squares summed too."""
    if not args.zero:
        return clip_global(runner.parameters(), args.clip_grad_norm, runner.norm_groups, runner.counted)
    return clip_global(optimizer.slices, args.clip_grad_norm, runner.norm_groups + [mesh.dp_group],
                       squares=optimizer.squares(runner.counted))


def train_job(args, env, mesh, runner, model, data, grads, shards, program, step=train_step, scores=None):
    """The loop's Job for D pipelines: the step (this file's, or parallel_3d.py's), the optimizer
    (--zero 1, 2, 3: mp.zero's, over my slices of the buckets), my layout, who logs; scores: the
    evaluation's of logits that are not whole (parallel_3d.py's gpt, mp.tp.vocab)."""
    optimizer = ZeroOptimizer(grads, args, shards) if args.zero else make_optimizer(runner.parameters(), args)
    # the same every step (zbv on gloo: its sends right after their compute, mp.pp.p2p)
    actions = schedule_actions(args.schedule, runner.pos, args.microbatches,
                               sends_at_once=runner.messenger.sends_at_once)
    owner = runner.pos.is_last_stage and mesh.dp_rank == 0 and mesh.tp_rank == 0   # logs the loss
    timeline = Timeline(args, runner, runner.pos, owner)
    layout = checkpoint.layout_of(program, env, dp=mesh.dp_size, pp=mesh.pp_size, tp=mesh.tp_size,
                                  schedule=args.schedule, virtual_stages=runner.pos.virtual)
    return timeline, Job(
        partial(step, runner=runner, optimizer=optimizer, actions=actions, data=data, args=args, mesh=mesh,
                grads=grads, timeline=timeline, shards=shards),
        model, optimizer, layout, owner,
        evaluate=partial(evaluate_replica, runner, mesh, data, env, optimizer, scores=scores),
        # logged: the replicas' losses averaged; the norm's squares summed as clip() sums them
        sums=Sums(replicas=mesh.dp_group, norm_groups=runner.norm_groups + ([mesh.dp_group] if args.zero else [])),
        versions=runner.versions.weights if runner.versions else None,
        # after the run: the replicas of every stage bit-identical (under --zero the same bytes by
        # construction: nothing to gather or compare, and the line says so)
        replicas=[Replicas(list(model.parameters()), mesh.dp_group, "parameters bit-identical across the "
                           f"{mesh.dp_size} replicas of every stage", args.zero)] + tied_replicas(runner))


def evaluate_replica(runner, mesh, data, env, optimizer, scores=None):
    """Replica 0's pipeline evaluates (the others hold the same weights). --zero 3: every replica runs it,
    each block's forward gathering it from the replicas' slices (whole_params: collectives over them)."""
    with whole_params(optimizer):
        every = runs_on_every_replica(optimizer)
        return evaluate_pipeline(runner, runner.pos, data, env.device, scores=scores) if mesh.dp_rank == 0 or every \
            else None


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("one replica of a one-stage pipeline")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        # every group of the mesh, made once and in the same order on every rank (mp/mesh.py); here
        # dp pipelines of world / dp stages, the cp and tp axes of size 1 (a tied gpt: one group more, each
        # pipeline's first and last stage, mp.pp.tied)
        mesh = Mesh.build(env.rank, env.world_size, dp=args.dp, timeout=group_timeout(env, args.timeout_s),
                          tied=tied_stages(args, env.world_size // args.dp))
        if env.rank == 0:
            print(f"grid (rows: pipelines, columns: data-parallel groups of one stage):\n"
                  f"{mesh.ranks.view(mesh.dp_size, mesh.pp_size)}", flush=True)
        pos = pipeline(mesh, args.virtual_stages, placement_of(args.schedule))   # 1 outside interleaved and zbv
        model, runner = setup_stage(args, env, pos)   # 2bw: every pipeline runs it on its slice
        tied = tie_embeddings(args, model, runner, mesh)   # the gpt's tied weight: first and last stage (mp.pp.tied)
        grads, shards = data_parallel_buckets(model, runner, mesh, args, late=tied.late)
        if args.check:   # each replica checks its slice of the first batch
            status = pipeline_check(env, args, model, runner, data, forward_backward, (mesh.dp_rank, mesh.dp_size),
                                    grads, tied.sum_grads,
                                    optimizer=ZeroOptimizer(grads, args, shards) if args.zero else None)
        else:
            timeline, job = train_job(args, env, mesh, runner, model, data, grads, shards, PROGRAM)
            status = train(args, env, job)   # the loop (mp/loop.py), then the replicas compared
            timeline.write()
    exit_now(status)


if __name__ == "__main__":
    main()
