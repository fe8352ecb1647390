"""Every axis at once: data x pipeline x tensor (sequence) x context x expert parallelism on one mesh.

The capstone: the lessons compose, each on its own group of mp.mesh, and the run still logs the
per-step loss of `single_baseline.py --microbatches M` (same expert flags). Nothing is copied: a stage
is parallel_3d.py's (pipeline_microbatch.py's schedules over tensor_parallel.py's sliced blocks), each
block then runs on my tokens (context_parallel.py's ring or Ulysses, on my tp rank's heads) and its
mixture of experts keeps my experts (expert_parallel.py's all-to-all, over the ep group folded over
dp x cp x tp). Written out here: where they meet (the experts' counts, the loss's scale, each sync's group).

    torchrun --standalone --nproc-per-node 8 -- parallel_5d.py --data synthetic --cp 2 --tp 2 \\
        --experts 4 --top-k 2 --ep 2 --microbatches 2                     (pp 2 = 8 ranks / (cp 2 x tp 2))
    torchrun --standalone --nproc-per-node 16 -- parallel_5d.py --data synthetic --dp 2 --cp 2 --tp 2 \\
        --experts 8 --ep 4 --schedule interleaved --microbatches 4

The mesh for 16 ranks, arange(16).view(dp 2, pp 2, cp 2, tp 2) (mp/mesh.py says why this order):

                    stage 0 (pp 0)               stage 1 (pp 1)
                   cp 0       cp 1              cp 0       cp 1
    replica 0:   [ 0 | 1 ]  [ 2 | 3 ]  ---->  [ 4 | 5 ]  [ 6 | 7 ]
    replica 1:   [ 8 | 9 ]  [10 |11 ]  ---->  [12 |13 ]  [14 |15 ]

    what runs where, per microbatch unless said (rank 0's groups):
    tp {0,1}        q,k,v column- / proj row-parallel: an all-reduce of [b, S/C, H] in each attention
    cp {0,2}        the ring (C-1 key/value blocks of [b, h/T, S/C, d] to the next rank) or Ulysses'
                    two all-to-alls; the head's all-reduce of the pooled [b, H]
    ep {0,1,2,3}    (ep 4) each MoE layer: my tp rank's run of my tokens (taken from the whole ones
                    without --sequence-parallel, the outputs all-gathered back over tp), the counts
                    all-gathered (over tp, then dp x cp), rows dispatched and combined by two all-to-alls
    pp {0,4}        the activation [b, S/C, H] (1/T of it when whole on every tp rank; [b, S/(C*T), H]
                    under --sequence-parallel) and its gradient
    dp x cp         {0,2,8,10}, once a step: the dense gradients' all-reduce, / (D*C), in buckets
    edp {0,8} (ep 4)  once a step: the experts' gradients, all-reduced and / (D*C) (not / edp size: the
                    all-to-all's backward already summed them over the ep ranks)

The data: microbatch m of the baseline is samples m*B/M .. (m+1)*B/M - 1; replica d runs its b = B/(M*D)
of them as its microbatch m, and cp rank c embeds those samples and keeps tokens c*S/C .. (c+1)*S/C - 1.
So the tokens a microbatch routes are the baseline's microbatch's, and its experts' counts (the load-
balancing loss's f_i, the capacity and its order) are gathered over every rank holding a part of them.
--model gpt (mp/cp/gpt_mesh.py): cp rank c holds the causal layout's tokens (zigzag: chunks c and 2C-1-c of 2C) at
their true positions, the ends split by the vocabulary over tp (mp/tp/vocab.py), the loss my tokens' sum x M D C / N,
a tied embedding's rows summed over the embed group (first and last stage, same dp, cp, tp: mp.pp.tied).
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

from functools import partial

import torch
import torch.distributed as dist

from mp import checkpoint
from mp.buckets import BucketSets, GradBuckets
from mp.check import check_and_exit
from mp.cli import parallel_5d_args
from mp.clipping import clip_global
from mp.cp.gpt_mesh import gpt_on_my_tokens, mesh_scores, whole_outputs
from mp.cp.zigzag import layout_of
from mp.data import agree_on_data, load_data
from mp.dist import awaiting, distributed, exit_now, group_timeout, torchrun_env
from mp.dropout import KeyedDropout
from mp.ep.evaluate import Traffic
from mp.ep.routing import WithAuxLoss, aux_loss_total
from mp.ep.order import from_order, gather_blocks, in_order, kept_mask_blocks, per_rank, sample_counts
from mp.errors import note_one_rank
from mp.loop import Job, Replicas, Sums, train
from mp.loss import loss_function
from mp.mesh import Mesh
from mp.mesh_picture import start_up
from mp.models import PatchEmbed, num_blocks
from mp.moe import (MixtureOfExperts, ahead_of, capacity_of, combine, kept_counts, route, rows_per_expert,
                    sorted_by_expert)
from mp.optim import whole_params
from mp.param_shards import ParamShards, weights_by_block
from mp.pp.balance import resolve_balance
from mp.pp.evaluate import evaluate_pipeline
from mp.pp.schedules import placement_of, schedule_actions
from mp.pp.tied import tie_embeddings, tied_replicas, tied_stages
from mp.pp.timeline import Timeline
from mp.replicas import average_replicated_grads, counted_once, not_tp_replicas
from mp.sizes import tokens_of
from mp.split import MicrobatchMajorKeys, my_microbatches, my_sample_indices
from mp.tp.mappings import (gather_from_sequence_parallel_region, gather_from_tp_region,
                             split_to_sequence_parallel_region)
from mp.tp.sequence import partial_gradients, sum_sequence_parallel_grads
from mp.tp.vocab import tp_loss_function
from mp.ep.zero import ExpertGrads, dense_units, mesh_optimizer   # ExpertGrads: the experts' sync over edp
# the lessons it composes
from context_parallel import ContextParallelAttention, ContextParallelEmbed, ContextParallelHead
from expert_parallel import AllToAll, ExpertParallelMoE
from parallel_3d import CutMessenger, note_whole_cuts
from pipeline_dp_joint import pipeline
from pipeline_microbatch import forward_backward, setup_stage
from tensor_parallel import copy_to_tp_region, parallelize_block, sync_tp_grads

PROGRAM = "parallel_5d"


def parse_args(argv=None):
    args = parallel_5d_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    resolve_balance(args, stages=torchrun_env("gloo").world_size // (args.dp * args.cp * args.tp))
    checkpoint.validate(args)                # the checkpoint to resume from, if any: whole, and of this run
    return args


# ----------------------------------------------------------------------------- a block: tp, then cp, then ep


class TensorContextAttention(ContextParallelAttention):
    """tensor_parallel.ParallelAttention's sliced q, k, v (my h/T heads) and row-parallel proj (its f and
    g on the tp group), with context_parallel.py's ring or Ulysses between them on the cp group (the gpt's:
    causal, over the layout's blocks, mp/cp/zigzag.py)."""

    def __init__(self, tp_attention, group, attention, layout=None):
        super().__init__(tp_attention, group, attention, layout)   # takes q, k, v, proj: the tp slices
        self.tp_group = tp_attention.group
        # sequence parallelism: my tp rank's tokens gathered into my cp rank's (proj reduce-scatters back)
        self.enter = gather_from_sequence_parallel_region if tp_attention.sequence_parallel else copy_to_tp_region

    def forward(self, x):
        return super().forward(self.enter(x, self.tp_group))


class _SumOverCP(torch.autograd.Function):
    """Forward: the cp ranks' shares of the pooled mean, summed (all-reduce). Backward: C times the gradient.
    Every cp rank computes the same loss from the same sum and the dense gradients are averaged over dp x cp
    (/ C too), so my tokens must get the sum of the C ranks' (identical) gradients: my tokens' share of every
    weight's gradient then survives the average. The classifier, after this point, is whole everywhere."""

    @staticmethod
    def forward(ctx, share, group):
        ctx.size = dist.get_world_size(group)
        share = share.clone()
        dist.all_reduce(share, group=group)
        return share

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


class SummedHead(ContextParallelHead):
    """The head on my tokens: my share of the pooled mean (under sequence parallelism summed over tp
    first, by the sequence-parallel head's g), summed over cp, then the classifier."""

    def __init__(self, full, group, tokens):
        super().__init__(full, group, tokens)
        self.tp = (full.reduce, full.group) if hasattr(full, "reduce") else None   # mp.tp.sequence's head

    def forward(self, x):
        share = self.ln(x).sum(dim=1) / self.tokens
        share = self.tp[0](share, self.tp[1]) if self.tp else share
        return self.fc(_SumOverCP.apply(share, self.group))


class TokenShardEmbed(ContextParallelEmbed):
    """The patch embedding, then my run of tokens: first, count (my cp rank's, or of them my tp rank's)."""

    def __init__(self, full, group, first, count):
        super().__init__(full, group)
        self.first, self.count = first, count

    def forward(self, x):   # a copy, not a view: a view would keep the whole embedding alive
        mine = PatchEmbed.forward(self, x).narrow(1, self.first, self.count)
        return mine.clone(memory_format=torch.contiguous_format)


def on_my_tokens(i, block, mesh, n_blocks, tokens, attention, sequence_parallel, layout):
    """Block i (already tensor-parallel) on my cp rank's S/C tokens (under sequence parallelism, my tp
    rank's S/(C*T) of them): context_parallel.context_parallel_block, with the attention on my tp heads
    and the head's sum that keeps the dp x cp average exact. The gpt (layout causal): its tokens at their
    true positions and its per-token head (mp.cp.gpt_mesh), the attention causal over the layout."""
    if mesh.cp_size == 1:   # the 3-D block as it is
        return block
    if layout.causal:
        block = gpt_on_my_tokens(i, block, layout, mesh.cp_rank, mesh.tp_group, sequence_parallel)
        if hasattr(block, "attn"):
            block.attn = TensorContextAttention(block.attn, mesh.cp_group, attention, layout)
        return block
    per_cp = tokens // mesh.cp_size
    count = per_cp // mesh.tp_size if sequence_parallel else per_cp
    first = mesh.cp_rank * per_cp + (mesh.tp_rank * count if sequence_parallel else 0)
    if i == 0:
        return TokenShardEmbed(block, mesh.cp_group, first, count)
    if i == n_blocks - 1:
        return SummedHead(block, mesh.cp_group, tokens)
    block.attn = TensorContextAttention(block.attn, mesh.cp_group, attention)
    for drop in (block.drop1, block.drop2):
        if isinstance(drop, KeyedDropout):   # my tokens' masks: those of these tokens in the full layer
            drop.first_token = first
    return block


class FoldedMoE(ExpertParallelMoE):
    """expert_parallel.ExpertParallelMoE on the mesh: my E/N experts, the all-to-all over the ep group (folded over
    dp x cp x tp), the counts of every rank holding this microbatch's tokens per (sample, token chunk) in the
    baseline's order. Each tp rank routes its own run of the tokens, so each is routed once, not T times."""

    def __init__(self, full, mesh, args, traffic):
        super().__init__(full, mesh.ep_group, traffic)
        self.dp_cp_group, self.dp, self.cp = mesh.dp_cp_group, mesh.dp_size, mesh.cp_size
        self.tp_group = mesh.tp_group if mesh.tp_size > 1 else None
        self.split = mesh.tp_size > 1 and not args.sequence_parallel   # whole tokens: my run of them taken here
        self.me = (mesh.dp_rank, mesh.cp_rank, mesh.tp_rank)
        # my ep group: ranks ep_first .. + N - 1 of my stage in (dp, cp, tp) order (mp/mesh.py)
        self.ep_first = mesh.dp_cp_rank * mesh.tp_size + mesh.tp_rank - mesh.ep_rank
        # my backward carries D*C / M of my share: dense gradients are / D*C, the loss a mean over M microbatches
        self.scale, self.shares = mesh.dp_cp_size / args.microbatches, []
        self.recompute = args.recompute       # its backward routes each microbatch again (mp.moe: rerun)
        if mesh.tp_size > 1:                  # the router on my tokens only: its gradients summed over tp; my
            partial_gradients(self.router)    # experts are mine alone (no tp sum, counted once in the norm)
            not_tp_replicas(*self.experts.parameters())

    def forward(self, x):
        if not self.split:
            return self.on_my_tokens(x)
        mine = split_to_sequence_parallel_region(x, self.tp_group)   # forward: my run; backward: all-gather
        y = self.on_my_tokens(mine)
        return gather_from_tp_region(y, self.tp_group, [mine.shape[1]] * dist.get_world_size(self.tp_group), dim=1)

    def on_my_tokens(self, x):
        b, t, h = x.shape
        x, me = x.reshape(b * t, h), dist.get_rank(self.group)
        probs, weights, choice = route(self.router, x, self.top_k)                  # 1. route my tokens
        blocks, samples = gather_blocks(sample_counts(choice, b, self.num_experts), self.dp_cp_group, self.dp,
                                        self.cp, self.tp_group, even=self.training_step is not None)   # 2. counts
        capacity = capacity_of(samples * blocks.shape[2:4].numel() * t, self.num_experts, self.top_k,
                               self.capacity_factor)
        ahead = from_order(ahead_of(in_order(blocks)), blocks.shape)                 # 3. the baseline's order
        kept = from_order(kept_counts(in_order(blocks), capacity), blocks.shape)
        self.record(probs, per_rank(blocks), per_rank(kept))   # f_i of the microbatch, my tokens' P_i share
        d, c, s = self.me
        # my ep group's ranks, their totals [N, K, E] (the evaluation's padding rows hold none): the one read
        rows = rows_per_expert(per_rank(kept)[self.ep_first:self.ep_first + dist.get_world_size(self.group)])
        send_splits = [sum(self.on_rank(rows[me], j)) for j in range(len(rows))]
        recv_splits = [sum(self.on_rank(rows[j], me)) for j in range(len(rows))]
        keep = kept_mask_blocks(choice, ahead[d, :b, c, s], capacity)   # (the evaluation: not the padding)
        token, slot = sorted_by_expert(keep, choice, self.num_experts, sum(rows[me]))
        traffic = self.traffic if self.training_step is not None else None
        received = AllToAll.apply(x[token], send_splits, recv_splits, self.group, traffic)   # 4. dispatch
        y = self.run_my_experts(received, [self.on_rank(rows[j], me) for j in range(len(rows))])   # 5. my experts
        y = AllToAll.apply(y, recv_splits, send_splits, self.group, traffic)        # 6. combine
        y = combine(y, token, slot, weights, b * t).view(b, t, h)
        if self.training_step is None:
            return y
        if not self.rerun:                    # --recompute's second forward: its share was logged by the first
            self.shares.append(self.aux_loss.detach())
        return WithAuxLoss.apply(y, self.aux_loss * self.scale)


def shard_block(i, block, args, mesh, n_blocks, traffic, layout):
    """Block i of the vit or the gpt as built from --seed: my tp slices, on my tokens, with my experts."""
    block = parallelize_block(i, block, args.model, mesh.tp_group, n_blocks, sequence_parallel=args.sequence_parallel,
                              tokens=tokens_of(args))
    block = on_my_tokens(i, block, mesh, n_blocks, tokens_of(args), args.attention, args.sequence_parallel, layout)
    if isinstance(getattr(block, "mlp", None), MixtureOfExperts):
        block.mlp = FoldedMoE(block.mlp, mesh, args, traffic)
    return block


# ----------------------------------------------------------------------------- the stage


def build_stage(args, env, mesh):
    """My stage's blocks, each sliced (shard_block), measured by one zero sample as parallel_3d.py's are
    (so every pipeline message has my token shard's shape, [S/C, H]), and the runner of my chunks."""
    pos = pipeline(mesh, args.virtual_stages, placement_of(args.schedule))
    traffic, layout = Traffic(), layout_of(args, mesh.cp_size)   # the gpt's tokens over cp (mp/cp/zigzag.py)
    shard = partial(shard_block, args=args, mesh=mesh, n_blocks=num_blocks(args), traffic=traffic, layout=layout)
    scattered = set()   # the cuts whose activation is whole on every tp rank (parallel_3d.py)
    if args.scatter_gather and not args.sequence_parallel:
        shard = note_whole_cuts(shard, args, pos, mesh.tp_group, scattered)
    model, runner = setup_stage(args, env, pos, shard, partial(CutMessenger, group=mesh.tp_group, scattered=scattered))
    keys = MicrobatchMajorKeys(args.seed, args.batch_size, args.microbatches, mesh.dp_rank, mesh.dp_size)
    for m in model.modules():   # every dropout layer and MoE reads the one keys object
        if getattr(m, "keys", None) is model.dropout_keys:
            m.keys = keys
    model.dropout_keys = runner.keys = keys
    model.all_to_all = traffic
    tie_embeddings(args, model, runner, mesh)   # the gpt's tied rows: first and last stage (mp.pp.tied)
    runner.layout = layout if layout.causal else None   # the gpt's: my targets, scores and --check's logits
    return pos, model, runner


def gradient_syncs(model, runner, mesh, args):
    """The three syncs and the norm's bookkeeping (each parameter knows how it is held):
    tp: sequence-parallel partial gradients summed (parallel_3d.py's); dp x cp: every dense gradient in
    buckets, averaged; edp: the experts. The norm counts a tp shard on its tp rank, a tp replica on tp
    rank 0, a dense weight on dp x cp rank 0 (all dp x cp ranks hold it) and an expert on edp rank 0, and sums
    over tp, then dp x cp (together every rank of a stage: the experts' ep groups may cross both), then pp."""
    experts = [p for m in model.modules() if isinstance(m, FoldedMoE) for p in m.experts.parameters()]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in runner.parameters() if id(p) not in expert_ids]
    tp_sums = (sum_sequence_parallel_grads(model, mesh.tp_group),
               average_replicated_grads(model, mesh.tp_group, next(model.parameters()).device))
    # every gradient a tp sum completes after the backward starts its bucket after that sum (late), so that no
    # two collectives ever read and write one buffer at once (and --zero 2 lets none of them go before it)
    late = [p for sums in tp_sums if sums for p in sums.params] + runner.tied.late   # (and the tied sum completes)
    direct = [w for stash in runner.stashes or [] for w in stash.weights]   # W writes these in place itself
    waiting = (f"rank {dist.get_rank()} waited for the dp x cp all-reduce, ranks {mesh.peers('dp_cp')}", args.timeout_s)
    # --zero 1: reduce-scattered, my 1/(D*C) stepped, all-gathered; 2: in every microbatch; 3: a bucket a block,
    # whose weights mp.param_shards gathers before it runs (the dp x cp ranks hold the same dense weights)
    grads = GradBuckets(dense, mesh.dp_cp_group, waiting, shard=args.zero >= 1, recorder=runner, late=late,
                        bucket_mb=args.bucket_mb, direct=direct, free=args.zero >= 2,
                        groups=weights_by_block(dense_units(runner.chunks)) if args.zero == 3 else None)
    grads.name_params(model.named_parameters())
    model.grad_buckets = grads
    shards = ParamShards(dense_units(runner.chunks), grads, args.zero3_gather) if args.zero == 3 else None
    expert_grads = ExpertGrads(experts, mesh, args, runner, late, direct)
    if expert_grads.buckets:
        expert_grads.buckets.name_params(model.named_parameters())
    tp_once, tied = counted_once(model, mesh.tp_group), runner.tied   # a tied gpt's rows: on the first stage
    on_tp, first_dp_cp, first_edp = lambda p: tp_once(p) and tied.counted(p), mesh.dp_cp_rank == 0, mesh.edp_rank == 0
    if not args.zero:   # whole gradients: each tensor counted on one rank of the stage, summed over tp, dp x cp, pp
        runner.counted = lambda p: on_tp(p) and (first_edp if id(p) in expert_ids else first_dp_cp)
        runner.norm_groups = [mesh.tp_group, mesh.dp_cp_group, mesh.pp_group]
    else:               # each dp x cp rank its slices (dp x cp = ep x edp: each expert slice once too)
        runner.counted, runner.norm_groups = on_tp, [mesh.tp_group, mesh.pp_group, mesh.dp_cp_group]
    return grads, expert_grads, tp_sums, shards


# ----------------------------------------------------------------------------- training


def train_step(step, runner, optimizer, actions, data, args, mesh, grads, expert_grads, tp_sums, shards, timeline):
    """One optimizer step on the 5-D mesh, in the order it runs."""
    timeline.begin(step)
    x, y = my_microbatches(data, step, args, mesh, runner.pos, runner.messenger.device, runner.layout)   # 1. my tokens
    grads.zero_grad(step)                 # 2. the dense buckets zeroed, each .grad a view into its bucket;
    expert_grads.zero_grad(step)          #    the experts' too
    # the gpt: my tokens' sum over the global batch's valid tokens, x M x D x C (the 1/M and the dp x cp average
    # undo it: mp.loss), from my vocabulary columns (mp.tp.vocab)
    loss_fn = tp_loss_function(args, data, step, mesh.tp_group, pieces=args.microbatches * mesh.dp_cp_size)
    with runner.keys.training(step):      # 3. the schedule: cp, tp and ep collectives inside the blocks,
        loss = forward_backward(runner, actions, x, y, args.microbatches,   # pp messages between stages;
                                samples=args.batch_size // mesh.dp_size,   # both sets of buckets start as the
                                grads=BucketSets(grads, expert_grads.buckets), loss_fn=loss_fn)   # backward ends
    for held in (shards, expert_grads.shards):
        if held:
            held.release()                #    --zero 3: the whole weights gathered for this step go
    sync_tp_grads(*tp_sums)               # 4. tp: sequence-parallel partial gradients summed (tp group);
    runner.tied.sum_grads()               #    a tied gpt's rows, first and last stage (embed group);
    grads.final_late()                    #    then their buckets start too
    grads.wait()                          # 5. dp x cp: every dense bucket all-reduced (--zero: reduce-scattered),
                                          #    / (D*C)
    expert_grads.average()                # 6. edp: the experts, all-reduced, / (D*C)
    aux = aux_loss_total(runner.model, mesh, args)   # the load-balancing loss, for the log (dp x cp, pp)
    with awaiting(f"rank {dist.get_rank()} waited for the gradient norm's sums of step {step}", args.timeout_s):
        norm = clip(runner, optimizer, args)                                   # 7. clip
    optimizer.step()                      # 8. update (--zero 1, 2: my slices, then the all-gather over dp x cp)
    timeline.end(step)
    return (loss + aux if aux is not None and loss is not None else loss), norm


def clip(runner, optimizer, args):
    """The global norm over the groups of runner.norm_groups; --zero: over my slices (mp.zero)."""
    if not args.zero:
        return clip_global(runner.parameters(), args.clip_grad_norm, runner.norm_groups, runner.counted)
    return clip_global(optimizer.slices, args.clip_grad_norm, runner.norm_groups,
                       squares=optimizer.squares(runner.counted))


def check_step(runner, actions, data, args, mesh, grads, expert_grads, tp_sums):
    """--check's step (mp.check): step 0 as train_step runs it, up to the gradients synchronised; mp.check
    compares my microbatches' outputs, in order, with the full model's at my samples (my_sample_indices)."""
    def step(x, y):
        x, y, outputs = *my_microbatches(data, 0, args, mesh, runner.pos, runner.messenger.device, runner.layout), {}
        grads.zero_grad(0)
        expert_grads.zero_grad(0)
        loss_fn = tp_loss_function(args, data, 0, mesh.tp_group, pieces=args.microbatches * mesh.dp_cp_size)
        with runner.keys.training(0):
            loss = forward_backward(runner, actions, x, y, args.microbatches, args.batch_size // mesh.dp_size,
                                    outputs=outputs, grads=BucketSets(grads, expert_grads.buckets), loss_fn=loss_fn)
        sync_tp_grads(*tp_sums)
        runner.tied.sum_grads()
        grads.final_late()
        grads.wait()
        expert_grads.average()
        logits = torch.cat([outputs[i] for i in range(args.microbatches)]) if outputs else None
        return whole_outputs(logits, loss, runner.layout, mesh.cp_group, mesh.tp_group)   # the gpt's: gathered
    return step


def evaluate_all(runner, mesh, data, env, optimizer, args):
    """Every replica runs its slice of each test batch, as a step runs its slice of the batch (D need not
    divide it: the counts are padded, mp.ep.order.gather_blocks): the experts' counts, gathered over dp x cp,
    are then the test batch's, and the capacity drops what the baseline's evaluation drops; the replicas'
    sums are added. --zero 3: a block's weights gathered as it runs. The owner's figures are logged. The gpt: each
    cp rank scores its tokens' vocabulary columns (mp.cp.gpt_mesh), the sums added over dp x cp."""
    gpt = runner.layout is not None
    scores = mesh_scores(args, runner.layout, mesh.cp_rank, mesh.tp_group) if gpt else None
    with whole_params(optimizer):
        result = evaluate_pipeline(runner, runner.pos, data, env.device,
                                   (mesh.dp_rank, mesh.dp_size, mesh.dp_cp_group if gpt else mesh.dp_group), scores)
    return result if mesh.dp_rank == 0 else None


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("a mesh of one rank")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        # every group of the mesh, made once and in the same order on every rank (mp/mesh.py)
        mesh = Mesh.build(env.rank, env.world_size, dp=args.dp, cp=args.cp, tp=args.tp, ep=args.ep,   # a tied gpt:
                          timeout=group_timeout(env, args.timeout_s),   # its embed group (mp.pp.tied)
                          tied=tied_stages(args, env.world_size // (args.dp * args.cp * args.tp)))
        pos, model, runner = build_stage(args, env, mesh)
        runner.model = model
        if env.rank == 0:   # the mesh by axis, my groups, what a pipeline message carries (mp/mesh_picture.py)
            print(start_up(mesh, runner.messenger, args), flush=True)
        grads, expert_grads, tp_sums, shards = gradient_syncs(model, runner, mesh, args)
        actions = schedule_actions(args.schedule, pos, args.microbatches, sends_at_once=runner.messenger.sends_at_once)
        optimizer = mesh_optimizer(runner.parameters(), grads, shards, expert_grads, args)
        if args.check:   # my shards (--zero: my slices) against the matching slices of a full model in this process
            x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
            exit_now(check_and_exit(env, args, f"5-D {args.schedule}", model, check_step(
                runner, actions, data, args, mesh, grads, expert_grads, tp_sums), x, y,
                samples=my_sample_indices(args.batch_size, args.microbatches, mesh.dp_rank, mesh.dp_size),
                norm=(runner.norm_groups, runner.counted), optimizer=optimizer if args.zero else None,
                # the gpt's: my replica's samples' tokens over the global count, x D x C (check_step sums over cp)
                loss_fn=loss_function(args, data, 0), piece_loss=loss_function(args, data, 0, mesh.dp_cp_size)))
        owner = pos.is_last_stage and mesh.dp_cp_rank == 0 and mesh.tp_rank == 0   # logs the loss
        timeline = Timeline(args, runner, pos, owner)
        layout = checkpoint.layout_of(PROGRAM, env, dp=mesh.dp_size, pp=mesh.pp_size, cp=mesh.cp_size,
                                      tp=mesh.tp_size, ep=mesh.ep_size, schedule=args.schedule,
                                      **({"cp_layout": args.cp_layout} if args.model == "gpt" else {}))
        step = partial(train_step, runner=runner, optimizer=optimizer, actions=actions, data=data, args=args,
                       mesh=mesh, grads=grads, expert_grads=expert_grads, tp_sums=tp_sums, shards=shards,
                       timeline=timeline)
        dense = [p for p in model.parameters() if id(p) not in {id(q) for q in expert_grads.params}]
        job = Job(step, model, optimizer, layout, owner,
                  evaluate=partial(evaluate_all, runner, mesh, data, env, optimizer, args),
                  # logged: the loss averaged over dp x cp (every cp rank holds its replica's), the norm's squares
                  # summed as clip_global sums them; after the last step, every stage's routing record gathered
                  # over the pipeline for the summary
                  sums=Sums(replicas=mesh.dp_cp_group, norm_groups=runner.norm_groups,
                            routing=mesh.pp_group if args.experts else None),
                  collectives="the 5-D mesh's collectives",
                  replicas=[Replicas(dense, mesh.dp_cp_group, "dense weights bit-identical across the "
                                     f"{mesh.dp_cp_size} dp x cp ranks of every stage", args.zero),
                            Replicas(expert_grads.params, mesh.edp_group, "experts bit-identical across their "
                                     f"{mesh.edp_size} expert-data-parallel ranks", args.zero)] + tied_replicas(runner))
        status = train(args, env, job)
        timeline.write()
    exit_now(status)


if __name__ == "__main__":
    main()
