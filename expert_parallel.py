"""Expert parallelism: the feed-forward blocks (the vit's, the gpt's) as a mixture of experts, spread over the ranks.

The lesson (Lepikhin et al. 2020, "GShard"; Fedus et al. 2021, "Switch Transformers"; Rajbhandari et al.
2022, "DeepSpeed-MoE"): with --experts E each block's MLP is E experts behind a router (mp/moe.py, the
model single_baseline.py trains), and each of the N ranks holds E/N of them. The experts ride on the
data-parallel ranks: each rank trains its own slice of the batch with its own copy of everything else
(embedding, attention, norms, router, head). A token whose expert lives elsewhere travels there and back:

    rank 0: experts 0 1                              rank 1: experts 2 3
    route my tokens: top-k of softmax(x W_r)         route my tokens
    count them per expert  --------- all_gather of the counts [N, K, E] ---------  (every rank, every split)
    sort my rows by expert:                          sort my rows by expert:
      [experts 0 1: to rank 0 | experts 2 3: to rank 1]  [experts 0 1: to rank 0 | experts 2 3: to rank 1]
                 \\--------- dispatch: all_to_all_single, rows split by rank ---------/
    run experts 0, 1 on the rows from ranks 0 and 1  run experts 2, 3 on the rows from ranks 0 and 1
                 /--------- combine: all_to_all_single back, the splits swapped ---------\\
    sum each token's outputs times its weights       sum each token's outputs times its weights

Each rank's experts are consecutive (expert e lives on rank e // (E/N)), so rows sorted by expert are
also sorted by the rank they go to: the dispatch needs no second sort. One value is read back from the
device a block a forward: how many rows go where, which all_to_all_single takes as Python ints.

The backward runs the two exchanges the other way (an all-to-all's conjugate is the inverse one). Why
exact: the counts of every rank give every rank the global batch's numbers (the load-balancing loss's
f_i, an expert's capacity and which tokens come first in it), and the rows an expert runs are the
baseline's rows. Each rank backpropagates its share of the global loss (its cross-entropy / N plus its
tokens' share of the load-balancing loss), so every gradient comes out a sum: an expert's is summed by
the all-to-all's backward over every rank's tokens, the replicated weights' are summed by an all-reduce.

What this adds to single_baseline.py, in order: AllToAll (forward and backward), ExpertParallelMoE (route,
count, exchange the counts, drop over capacity, dispatch, my experts, combine back, weight and sum), the
model built with my experts only, and train_step: the baseline's on my slice, the replicated gradients
summed before the norm.

    torchrun --standalone --nproc-per-node 2 expert_parallel.py --data synthetic --experts 4
    torchrun --standalone --nproc-per-node 4 expert_parallel.py --data synthetic --experts 8 --top-k 2 --check
    torchrun --standalone --nproc-per-node 2 expert_parallel.py --data synthetic --capacity-factor 1.25
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

import torch
import torch.distributed as dist
import torch.nn as nn

from mp import checkpoint
from mp.check import check_and_exit
from mp.cli import expert_parallel_args
from mp.clipping import clip_global
from mp.data import agree_on_data, dp_slice, load_data, to_device
from mp.dist import distributed, exit_now, group_timeout
from mp.ep.evaluate import Traffic, sliced_run
from mp.errors import note_one_rank
from mp.loop import Job, Replicas, Sums, evaluate, train
from mp.loss import loss_function
from mp.mesh import Mesh
from mp.models import build_model
from mp.moe import (MixtureOfExperts, aux_loss, capacity_of, combine, kept_counts, kept_mask, route, rows_per_expert,
                    slot_counts, sorted_by_expert)
from mp.optim import make_optimizer
from mp.replicas import SummedGradients

PROGRAM = "expert_parallel"


def parse_args(argv=None):
    args = expert_parallel_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    checkpoint.validate(args)                     # the checkpoint to resume from, if any: whole, and of this run
    return args


def ep_rank(group):
    return dist.get_rank(group) if dist.is_initialized() else 0


def ep_size(group):
    return dist.get_world_size(group) if dist.is_initialized() else 1


# ----------------------------------------------------------------------------- the all-to-all


def all_to_all_rows(x, send_splits, recv_splits, group, traffic):
    """Rows of x in rank order, send_splits[j] of them to rank j; returns the rows received, recv_splits[j]
    from rank j, in rank order. Every rank calls it with its own splits: mine to j is j's from me."""
    out = x.new_empty(sum(recv_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    if traffic is not None:
        traffic.add(x, send_splits, ep_rank(group))
    return out


class AllToAll(torch.autograd.Function):
    """Forward: all_to_all_rows; backward: each row's gradient goes back where the row came from (the
    same exchange with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, traffic):
        ctx.splits, ctx.group, ctx.traffic = (send_splits, recv_splits), group, traffic
        return all_to_all_rows(x, send_splits, recv_splits, group, traffic)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return all_to_all_rows(grad, recv_splits, send_splits, ctx.group, ctx.traffic), None, None, None, None


def exchange_counts(counts, group):
    """[K, E] my tokens' choices per expert -> [N, K, E] every rank's. The textbook exchanges the counts
    with an all-to-all (each rank learns only what it will receive); here every rank needs them all: the
    load-balancing loss's f_i and the capacity's order are of the global batch, as in the baseline."""
    every = [torch.empty_like(counts) for _ in range(ep_size(group))]
    dist.all_gather(every, counts.contiguous(), group=group)
    return torch.stack(every)


# ----------------------------------------------------------------------------- the mixture of experts over the ranks


class ExpertParallelMoE(MixtureOfExperts):
    """mp.moe.MixtureOfExperts with its router and my E/N experts only (named as in the full model:
    experts.2.0.weight is expert 2's on whichever rank holds it), the tokens of my slice of the batch
    dispatched to their experts' ranks and combined back."""

    def __init__(self, full, group, traffic):
        nn.Module.__init__(self)   # not MixtureOfExperts.__init__: the router and the experts are the full block's
        n = ep_size(group)
        self.per_rank = full.num_experts // n
        self.my_first_expert = ep_rank(group) * self.per_rank     # mine: my_first_expert .. + E/N - 1
        self.router = full.router
        self.experts = nn.ModuleDict({str(self.my_first_expert + e): full.experts[self.my_first_expert + e]
                                      for e in range(self.per_rank)})
        self.num_experts, self.top_k, self.capacity_factor = full.num_experts, full.top_k, full.capacity_factor
        self.aux_weight, self.keys, self.load, self.aux_loss = full.aux_weight, full.keys, full.load, None
        self.group, self.traffic = group, traffic

    def forward(self, x):
        b, t, h = x.shape
        x, n, me = x.reshape(b * t, h), ep_size(self.group), ep_rank(self.group)
        # 1. route: each of my tokens picks its top-k experts (every rank holds the whole router)
        probs, weights, choice = route(self.router, x, self.top_k)
        # 2. count my tokens per (slot, expert), 3. exchange the counts: [N, K, E] on every rank
        counts = exchange_counts(slot_counts(choice, self.num_experts), self.group)
        # 4. capacity: of the global batch's n * b * t tokens (every rank holds an equal slice); how many of
        # each rank's choices each expert runs (all of them, dropless)
        capacity = capacity_of(n * b * t, self.num_experts, self.top_k, self.capacity_factor)
        kept = kept_counts(counts, capacity)                                # [N, K, E]
        self.record(probs, counts, kept)   # my tokens' share of the load-balancing loss (f_i of the global batch)
        # rows[j][e]: how many of rank j's rows expert e runs. The one read from the device: the all-to-all
        # takes its splits as Python ints. Everything below is arithmetic on this table, on the host
        rows = rows_per_expert(kept)
        send_splits = [sum(self.on_rank(rows[me], j)) for j in range(n)]     # my rows for rank j's experts
        recv_splits = [sum(self.on_rank(rows[j], me)) for j in range(n)]     # rank j's rows for my experts
        token, slot = sorted_by_expert(kept_mask(choice, counts, me, capacity), choice, self.num_experts, sum(rows[me]))
        traffic = self.traffic if self.training_step is not None else None   # the bytes of training steps only
        # 5. dispatch: my kept rows, sorted by expert and so by rank, to their experts' ranks
        received = AllToAll.apply(x[token], send_splits, recv_splits, self.group, traffic)
        # 6. my experts on every rank's rows
        y = self.run_my_experts(received, [self.on_rank(rows[j], me) for j in range(n)])
        # 7. combine: the outputs back to the ranks their tokens came from, in the order they were sent
        y = AllToAll.apply(y, recv_splits, send_splits, self.group, traffic)
        # 8. weight each output by its router weight and sum a token's outputs
        return combine(y, token, slot, weights, b * t).view(b, t, h)

    def on_rank(self, per_expert, j):
        """The entries of a per-expert list that belong to rank j's experts (consecutive: j * E/N ...)."""
        return per_expert[j * self.per_rank:(j + 1) * self.per_rank]

    def run_my_experts(self, received, sizes):
        """received: rank 0's rows (those for my first expert, then for my second ...), then rank 1's ...;
        sizes[j][e]: how many of rank j's rows are for my e-th expert. Each expert runs its rows of every rank
        at once, in rank order (the baseline's order of tokens); the outputs go back in received's order."""
        ranks = range(len(sizes))
        pieces = received.split(sum(sizes, []))              # pieces[j * E/N + e]: rank j's rows for expert e
        outputs = []                                          # outputs[e][j]: expert e's output for rank j's rows
        for e in range(self.per_rank):
            mine = [pieces[j * self.per_rank + e] for j in ranks]
            # every expert runs, on no rows too: a zero gradient, as in the baseline (SGD's momentum steps on it)
            y = self.experts[str(self.my_first_expert + e)](torch.cat(mine))
            outputs.append(y.split([len(piece) for piece in mine]))
        return torch.cat([outputs[e][j] for j in ranks for e in range(self.per_rank)])


def expert_parallel_block(block, group, traffic):
    """Block i of the vit as built from --seed: a transformer block's mixture of experts keeps my experts
    only (the others are freed with the full block); the rest is kept whole."""
    if isinstance(getattr(block, "mlp", None), MixtureOfExperts):
        block.mlp = ExpertParallelMoE(block.mlp, group, traffic)
    return block


def build_expert_parallel_model(args, group, device):
    """The vit block by block from --seed, each rank keeping the replicated weights and its E/N experts
    (the memory contract); the replicated weights' gradients are summed over the ranks (SummedGradients)."""
    traffic = Traffic()
    model = build_model(args, lambda i, block: expert_parallel_block(block, group, traffic), device)
    expert_ids = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
    model.replicated_grads = SummedGradients([p for p in model.parameters() if id(p) not in expert_ids], group)
    # the gradient norm counts an expert on its rank, a replicated weight (whole everywhere after the sum) on rank 0
    rank_0 = ep_rank(group) == 0
    model.counted = lambda p: rank_0 or id(p) in expert_ids
    model.all_to_all = traffic
    return model


# ----------------------------------------------------------------------------- training


def forward_backward(model, x, y, step, n, me, loss_fn):
    """My slice's forward and backward; returns (my logits, my slice's cross-entropy, my share of the
    load-balancing loss). Backward on my share of the global loss, ce / N + aux: summed over the ranks it
    is the baseline's loss, so every gradient is a sum of the ranks' parts. loss_fn: my slice's mean
    cross-entropy (the gpt's: my valid tokens' sum times N / the global batch's count, mp/loss.py, so
    that ce / N is my share however many valid tokens my slice holds)."""
    with model.dropout_keys.training(step, first_sample=me * len(y)):   # my samples' masks, by global index
        logits = model(x)                   # the dispatch and the combine run inside each block
    ce, aux = loss_fn(logits, y), aux_loss(model)
    (ce / n + aux).backward()               # the all-to-alls' backwards send the gradients home
    return logits, ce, aux


def train_step(step, model, optimizer, data, args, device, group, norm):
    """One optimizer step of single_baseline.py's, on my slice of the batch: the same order, the experts'
    all-to-alls inside the forward and the backward, the replicated gradients summed before the norm."""
    n, me = ep_size(group), ep_rank(group)      # my slice of the batch: the experts ride on the data axis
    b = args.batch_size // n
    x = to_device(data.images(step, args.batch_size, me * b, b), device)       # only my samples are drawn
    y = to_device(dp_slice(data.labels(step, args.batch_size), me, n), device)
    optimizer.zero_grad(set_to_none=True)
    _, ce, aux = forward_backward(model, x, y, step, n, me, loss_function(args, data, step, pieces=n))
    model.replicated_grads.sum()            # the data-parallel sync: the replicated weights' parts summed
    grad_norm = clip_global(model.parameters(), args.clip_grad_norm, *norm)   # the full model's norm
    optimizer.step()
    # the loop averages what each rank returns over the N ranks and logs it; the baseline logs its mean
    # cross-entropy plus the load-balancing loss. The slices are equal, so the average of the ranks' ce is
    # the batch's; aux is my share of the load-balancing loss, the N shares sum to it, so each rank returns
    # N times its share and the average of those is the sum
    return (ce + n * aux).detach(), grad_norm


def main(argv=None):
    args = parse_args(argv)
    note_one_rank(f"expert parallelism of degree 1, all {args.experts} experts on one rank")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        # the one mesh (mp/mesh.py): every rank a data-parallel replica, the experts folded over all of them
        mesh = Mesh.build(env.rank, env.world_size, dp=env.world_size, ep=env.world_size,
                          timeout=group_timeout(env, args.timeout_s))
        group = mesh.ep_group
        model = build_expert_parallel_model(args, group, env.device)
        norm = ([group], model.counted)
        if args.check:
            x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
            piece_loss = loss_function(args, data, 0, pieces=mesh.dp_size)
            return check_and_exit(env, args, f"expert parallelism, {args.experts} experts (top-{args.top_k})",
                                  model, check_step(model, group, piece_loss), x, y,
                                  replica=(mesh.dp_rank, mesh.dp_size), norm=norm,
                                  loss_fn=loss_function(args, data, 0), piece_loss=piece_loss)
        optimizer = make_optimizer(model.parameters(), args)

        def step(k):
            return train_step(k, model, optimizer, data, args, env.device, group, norm)

        # the loop (mp/loop.py) runs the steps, logs (rank 0), evaluates (every rank: the experts communicate),
        # saves, and at the end checks that the replicated weights stayed bit-identical
        layout = checkpoint.layout_of(PROGRAM, env, ep=env.world_size, experts=args.experts)
        replicas = Replicas(model.replicated_grads.params, group, "replicated weights bit-identical across the "
                            f"{env.world_size} expert-parallel ranks")
        return train(args, env, Job(step, model, optimizer, layout, owner=env.rank == 0,
                                    sums=Sums(replicas=group, norm_groups=[group]),
                                    evaluate=lambda: evaluate(data, env.device, sliced_run(model, env.device, group)),
                                    collectives="the expert-parallel exchanges", replicas=[replicas]))


def check_step(model, group, loss_fn):
    """--check's step (mp.check): my slice's forward and backward on the first batch, the replicated
    gradients summed; the loss compared is my slice's cross-entropy."""
    def step(x, y):
        logits, ce, _ = forward_backward(model, x, y, 0, ep_size(group), ep_rank(group), loss_fn)
        model.replicated_grads.sum()
        return logits, ce
    return step


if __name__ == "__main__":
    exit_now(main())  # everything is written and torn down: skip gloo's destructors (mp.dist.exit_now)
