"""Data x pipeline x tensor parallelism: D replicas of a P-stage pipeline whose every stage is split over T ranks.

The lesson (Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters
using Megatron-LM"): the three programs compose, each on its own axis of a 3-D grid of ranks. The
stages of pipeline_microbatch.py are made of tensor_parallel.py's sharded layers; the pipelines are
the replicas of pipeline_dp_joint.py. Nothing is copied: this file only wires them together on
the groups of mp.mesh, and it still logs the per-step loss of single_baseline.py.

    torchrun --standalone --nproc-per-node 8 -- parallel_3d.py --data synthetic --dp 2 --tp 2
    torchrun --standalone --nproc-per-node 8 -- parallel_3d.py --data synthetic --dp 2 --tp 2 --check
    torchrun --standalone --nproc-per-node 4 -- parallel_3d.py --data synthetic --dp 1 --tp 2 --model vit
    torchrun --standalone --nproc-per-node 4 -- parallel_3d.py --data synthetic --dp 1 --tp 2 --model vit --sequence-parallel

The grid for 8 ranks: mp.mesh's arange(world).view(dp, pp, cp, tp) with cp 1, that is view(dp, pp, tp), so
rank = (dp_rank * pp + pp_rank) * tp + tp_rank (tp innermost, on the fastest links: mp/mesh.py says why).

                          stage 0                  stage 1
    replica 0:   [ rank 0 | rank 1 ]  ---->  [ rank 2 | rank 3 ]     [ | ]  a tp group: every layer of the
                                                                            stage split in two, collectives
    replica 1:   [ rank 4 | rank 5 ]  ---->  [ rank 6 | rank 7 ]            inside every layer
                                                                     ---->  pp groups {0,2} {1,3} {4,6} {5,7}:
                                                                            tp rank t sends to tp rank t
    dp groups (same stage, same tp rank): {0,4} {1,5} {2,6} {3,7}: the gradient sync, per bucket one
                                          all-reduce a step (--zero 1: a reduce-scatter; --zero 2, 3: M of
                                          them, one a microbatch; pipeline_dp_joint.py lists them all)

What crosses a pipeline cut is what the sending rank holds there, and never the same bytes twice:

    after a column-parallel layer   my shard of the features (the cnn after fc1: 60 of 120 at T = 2);
                                    the next stage's row-parallel layer wants exactly that shard
    after a row-parallel layer      the whole activation, the same on every tp rank (its all-reduce):
                                    each tp rank sends 1/T of it and the receivers all-gather it
                                    (scatter/gather, Narayanan et al. 2021 section 4.1; on by default,
                                    --no-scatter-gather sends it whole from every tp rank)
    --sequence-parallel (vit)       my run of the tokens, [B, 64/T, H]: already 1/T, nothing gathered

                 stage s                                 stage s+1
    tp rank 0:  y (whole) -> keep y0 = y[:, :n/2] --send-->  y0 --+
                                                                  all-gather (tp group) -> [y0 | y1] = y
    tp rank 1:  y (whole) -> keep y1 = y[:, n/2:] --send-->  y1 --+

In backward each gradient goes back the same way. Both sides know every shape up front, per rank:
build_stage_model() runs one zero sample through the tensor-parallel blocks as they are built.

--model gpt: the first stage's embedding and the last stage's head are split by rows of the vocabulary
(mp/tp/vocab.py), so the last stage's tp ranks each hold the logits of V/T bytes and reduce the loss's
max, sum and target over their tp group; the loss is each microbatch's token sum over the global batch's
valid tokens, times M x D (mp/loss.py). --tie-embeddings: tp rank t of the first stage and tp rank t of the
last hold the same V/T rows of the tied weight, and sum their two gradients over the mesh's embed group
({0,2} {1,3} {4,6} {5,7} above: a pp line, the same dp and tp coordinates), as pipeline_dp_joint.py does.

    torchrun --standalone --nproc-per-node 8 -- parallel_3d.py --data synthetic --dp 2 --tp 2 \\
        --model gpt --tie-embeddings
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

import math
from functools import partial

import torch
import torch.distributed as dist

from mp import checkpoint
from mp.cli import grid_args
from mp.data import agree_on_data, load_data
from mp.dist import awaiting, distributed, exit_now, group_timeout, torchrun_env
from mp.errors import note_one_rank
from mp.loop import Replicas, train
from mp.mesh import Mesh
from mp.models import num_blocks
from mp.pp.tied import tie_embeddings, tied_stages
from mp.pp.balance import resolve_balance
from mp.pp.schedules import placement_of
from mp.pp.training import pipeline_check, stage_batch
from mp.sizes import split_sizes, tokens_of
from mp.tp.collectives import all_gather, tp_rank, tp_size
from mp.replicas import average_replicated_grads, counted_once, replicated_parameters
from mp.tp.sequence import sum_sequence_parallel_grads
from mp.tp.vocab import tp_loss_function, vocab_parallel_scores
from mp.zero import ZeroOptimizer
# the three programs it composes: the grid's replicas, a pipeline's stages, the tensor-parallel layers
from pipeline_dp_joint import clip, data_parallel_buckets, pipeline, train_job
from pipeline_microbatch import Messenger, forward_backward, partition, setup_stage
from tensor_parallel import (ColumnParallelConv2d, ColumnParallelLinear, RowParallelConv2d, RowParallelLinear,
                             parallelize_block, sync_tp_grads)

PROGRAM = "parallel_3d"


def parse_args(argv=None):
    args = grid_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    resolve_balance(args, stages=torchrun_env("gloo").world_size // (args.dp * args.tp))   # --balance auto
    checkpoint.validate(args)               # the checkpoint to resume from, if any: whole, and of this run
    return args


# ----------------------------------------------------------------------------- the stage


def build_stage(args, env, mesh):
    """Every rank builds the model block by block from --seed, slices each block to its tp rank's
    shards (tensor_parallel.parallelize_block over the tp group), and keeps the shards of its
    stage's blocks only. The zero sample that measures each cut runs through the sliced blocks,
    their tp collectives included (every rank of a tp group runs the same blocks), so a cut after a
    column-parallel layer or a sequence-parallel one gives this rank's part's shape (a scattered cut's
    message is CutMessenger's slice of the whole).
    Returns (my place in my pipeline, my stage's sliced blocks, named as in the full model, the
    runner of my chunks, (the partial gradients to sum over the tp group, the replicated gradients
    to average over it: each None where there are none))."""
    pos = pipeline(mesh, args.virtual_stages, placement_of(args.schedule))   # zbv: its V (pipeline_dp_joint.py)
    shard = partial(parallelize_block, model_name=args.model, group=mesh.tp_group, n_blocks=num_blocks(args),
                    sequence_parallel=args.sequence_parallel, tokens=tokens_of(args))
    scattered = set()   # the cuts whose activation is whole on every tp rank: filled while the blocks are built
    if args.scatter_gather and not args.sequence_parallel:   # sequence-parallel cuts are token shards already
        shard = note_whole_cuts(shard, args, pos, mesh.tp_group, scattered)
    # zb: the shards' ops defer their weight gradients to W
    model, runner = setup_stage(args, env, pos, shard, partial(CutMessenger, group=mesh.tp_group, scattered=scattered))
    # the norms and the embedding that see my tokens only: summed after the step's last backward
    # (train_step's sync_tp_grads), not after each microbatch's
    partial_sums = sum_sequence_parallel_grads(model, mesh.tp_group)
    # on a GPU, keep TP-replicated parameters identical (CPU gradients already are): once a step
    replicated = average_replicated_grads(model, mesh.tp_group, env.device)
    tied = tie_embeddings(args, model, runner, mesh)   # the gpt's tied rows: first and last stage (mp.pp.tied)
    # the gradient norm (mp.clipping): summed over my stage's tp shards (its replicated tensors
    # counted by tp rank 0 only; the tied rows on the first stage only), then over the stages; not over
    # replicas, whose gradients are averaged
    once = counted_once(model, mesh.tp_group)
    runner.norm_groups = [mesh.tp_group, mesh.pp_group]
    runner.counted = (lambda p: once(p) and tied.counted(p)) if tied.shared else once
    return pos, model, runner, (partial_sums, replicated)


def sync_grads(runner, tp_sums):
    """After the step's last backward, before the data-parallel buckets' late start: the tensor-parallel sums,
    then a tied gpt's first and last stage's parts of my vocabulary rows (over the embed group)."""
    sync_tp_grads(*tp_sums)
    runner.tied.sum_grads()


def train_step(step, runner, optimizer, actions, data, args, mesh, grads, timeline, tp_sums, shards=None):
    """One optimizer step on the 3-D mesh, in the order it runs: pipeline_dp_joint.train_step with the
    tensor-parallel sums between the backward and the data-parallel average."""
    timeline.begin(step)
    samples = args.batch_size // mesh.dp_size     # my replica's contiguous slice of the global batch
    x, y = stage_batch(data, step, args, runner, runner.messenger.device, (mesh.dp_rank, mesh.dp_size))
    grads.zero_grad(step)                 # the buckets zeroed, each .grad a view into its bucket again
    # the gpt: my vocabulary columns' token sums over the global batch's valid tokens, x M x D (mp.tp.vocab)
    loss_fn = tp_loss_function(args, data, step, mesh.tp_group, pieces=args.microbatches * mesh.dp_size)
    with runner.keys.training(step):      # tp collectives inside every layer; dp buckets start in the backward
        loss = forward_backward(runner, actions, x, y, args.microbatches, samples, mesh.dp_rank * samples, grads=grads,
                                loss_fn=loss_fn)
    if shards:
        shards.release()                  # --zero 3: the whole weights gathered for this step go
    sync_grads(runner, tp_sums)           # tensor parallelism first: its partial gradients made whole (and the
    grads.final_late()                    # tied rows summed), then their buckets start too
    grads.wait()                          # data parallelism: every bucket's all-reduce, then / D
    with awaiting(f"rank {dist.get_rank()} waited for the gradient norm's sums of step {step}", args.timeout_s):
        norm = clip(runner, optimizer, args, mesh)   # over tp shards, stages (--zero 1, 2, 3: and replicas)
    runner.update(optimizer)              # --zero 1, 2: my slices, then the all-gather (3: my slices only)
    timeline.end(step)
    return loss, norm


# ----------------------------------------------------------------------------- scatter/gather at a cut


class CutMessenger(Messenger):
    """pipeline_microbatch.Messenger, where a cut's activation is whole on every tp rank (`scattered`:
    the cuts, numbered by the virtual stage after them): each tp rank sends only its 1/t of the
    flattened activation, and the receivers all-gather the t slices over their tp group. Its gradient
    goes back the same way: the next stage's input gradient is whole on every tp rank (its first
    layer's f all-reduced it), so each sends back its slice of it, and the sender all-gathers them."""

    def __init__(self, pos, shapes, device, timeout_s, group, scattered, **options):
        super().__init__(pos, shapes, device, timeout_s, **options)
        self.group, self.scattered = group, set(scattered)   # filled by the build, which ran first

    def cut(self, msg):
        """The scattered cut a message crosses (None: it goes whole): an activation enters the receiver's
        virtual stage, a gradient leaves the sender's (the receiver's + 1)."""
        what, _, vstage = msg
        cut = vstage + (what == "grad")
        return cut if cut in self.scattered else None

    def sizes(self, cut):                         # each tp rank's share of the flattened activation
        return split_sizes(math.prod(self.shapes[cut]), tp_size(self.group))

    def mine(self, whole, cut):                   # what this tp rank sends across the cut
        sizes, rank = self.sizes(cut), tp_rank(self.group)
        return whole.flatten(1).narrow(1, sum(sizes[:rank]), sizes[rank])

    def send_forward(self, y, peer, msg):         # my slice of my output
        cut = self.cut(msg)
        return super().send_forward(y if cut is None else self.mine(y, cut), peer, msg)

    def send_backward(self, dx, peer, msg):       # my slice of my input's gradient
        cut = self.cut(msg)
        return super().send_backward(dx if cut is None else self.mine(dx, cut), peer, msg)

    def buffer(self, msg, mb_size):
        cut = self.cut(msg)
        if cut is None:
            return super().buffer(msg, mb_size)
        return torch.empty((mb_size, self.sizes(cut)[tp_rank(self.group)]), device=self.device)

    def exchange(self, parts, outbox, mb_size, record=None, ahead=(), meanwhile=None):
        received = super().exchange(parts, outbox, mb_size, record, ahead, meanwhile)
        for msg, part in received.items():        # the t slices all-gathered into the whole, in my tp group
            cut = self.cut(msg)
            if cut is not None:
                received[msg] = all_gather(part, self.group, self.sizes(cut), 1).view(-1, *self.shapes[cut])
        return received

    def message_shape(self, cut):                 # per sample, on this rank (describe())
        return [self.sizes(cut)[tp_rank(self.group)]] if cut in self.scattered else list(self.shapes[cut])


def whole_output(block):
    """Does the block end with the whole activation on every tp rank? Yes after a row-parallel layer
    (its all-reduce), a gathering column-parallel layer, or no sharded layer at all (the vit's
    embedding); no after a plain column-parallel layer (my features) or a sequence-parallel one (my tokens)."""
    row, column = (RowParallelLinear, RowParallelConv2d), (ColumnParallelLinear, ColumnParallelConv2d)
    sharded = [m for m in block.modules() if isinstance(m, row + column)]
    if not sharded:
        return True
    return not sharded[-1].sequence_parallel if isinstance(sharded[-1], row) else sharded[-1].gather_output


def note_whole_cuts(shard, args, pos, group, scattered):
    """shard(i, block), noting in `scattered` each cut between virtual stages that follows a block ending
    whole. Every rank builds every block in order, so it knows every cut, its own or not."""
    bounds = partition(num_blocks(args), pos.pp_size * pos.virtual, args.balance)
    cut_after = {start - 1: cut for cut, (start, _) in enumerate(bounds) if cut > 0}

    def shard_and_note(i, block):
        block = shard(i, block)
        if i in cut_after and tp_size(group) > 1 and whole_output(block):
            scattered.add(cut_after[i])
        return block
    return shard_and_note


def describe(mesh, messenger):
    """The grid with the three kinds of group marked, and what each tp rank sends at each cut."""
    dp, pp, tp = mesh.dp_size, mesh.pp_size, mesh.tp_size
    lines = [f"grid = arange({mesh.ranks.numel()}).view(dp {dp}, pp {pp}, tp {tp}):", str(mesh.ranks.view(dp, pp, tp))]
    what = {"tp": "one stage's layers split, collectives in every layer",
            "pp": "one pipeline, point-to-point between neighbouring stages",
            "dp": "same stage and tp rank, the gradient sync: a collective per bucket, M a step under --zero 2/3"}
    if "embed" in mesh.lines:
        what["embed"] = "a tied gpt's first and last stage, same dp and tp rank: the tied rows' gradient sum"
    for name in what:
        lines.append(f"{name} groups ({what[name]}): " + " ".join(map(str, mesh.lines[name])))
    cuts = ", ".join(str(messenger.message_shape(c)) for c in range(1, len(messenger.shapes))) or "none (one stage)"
    lines.append(f"per-sample message at each cut, on tp rank 0: {cuts}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- training


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("a grid of 1 x 1 x 1")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        # every group of the mesh, made once and in the same order on every rank (mp/mesh.py): the dp, pp
        # and tp axes here, cp of 1 (a tied gpt: the embed group, each pipeline's first and last stage, mp.pp.tied)
        mesh = Mesh.build(env.rank, env.world_size, dp=args.dp, tp=args.tp, timeout=group_timeout(env, args.timeout_s),
                          tied=tied_stages(args, env.world_size // (args.dp * args.tp)))
        pos, model, runner, tp_sums = build_stage(args, env, mesh)
        if env.rank == 0:
            print(describe(mesh, runner.messenger), flush=True)
        # the data-parallel buckets of the 2-D program over the ranks with my (pp, tp) coordinates; the
        # gradients the tp sums (and the tied sum) complete start their buckets after those sums (late)
        late = [p for sums in tp_sums if sums for p in sums.params] + runner.tied.late
        grads, shards = data_parallel_buckets(model, runner, mesh, args, late)
        if args.check:   # my shards against the matching slices of a full model in this process
            status = pipeline_check(env, args, model, runner, data, forward_backward, (mesh.dp_rank, mesh.dp_size),
                                    grads, sum_first=partial(sync_grads, runner, tp_sums),
                                    optimizer=ZeroOptimizer(grads, args, shards) if args.zero else None,
                                    vocab_group=mesh.tp_group)
        else:   # the loss is logged by tp rank 0 of replica 0's last stage
            timeline, job = train_job(args, env, mesh, runner, model, data, grads, shards, PROGRAM,
                                      step=partial(train_step, tp_sums=tp_sums),
                                      scores=vocab_parallel_scores(args, mesh.tp_group))
            # two kinds of replica to compare after the run: the stage's over dp (train_job's), and the
            # tensors every tp rank holds whole
            job.replicas.append(Replicas(replicated_parameters(model), mesh.tp_group, "replicated parameters "
                                         f"bit-identical across the {mesh.tp_size} tensor-parallel ranks"))
            status = train(args, env, job)
            timeline.write()
    exit_now(status)


if __name__ == "__main__":
    main()
