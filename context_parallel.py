"""Context parallelism: the vit's or the gpt's sequence split across ranks, attention included.

The lesson (Liu et al. 2023, "Ring attention with blockwise transformers"; Jacobs et al. 2023,
"DeepSpeed Ulysses"): every rank holds the whole (small) model but only its run of T/N tokens, so
every activation is N times smaller. Everything but attention is per token and runs on the shard
alone; attention needs every token's keys and values, and gets them one of two ways:

    --attention ring      each rank keeps its queries; the key/value blocks travel round the ring
                          (isend to the next rank, irecv from the previous), one block a tick, and
                          each block's scores are merged into a running softmax (max and sum per query)
    --attention ulysses   one all-to-all swaps the token shard for a head shard (all T tokens, h/N
                          heads), attention runs locally, a second all-to-all swaps back

The ring's schedule on 4 ranks: the key/value block each rank holds at each tick (rank r starts with
its own, r, and receives r-1's while it computes on r's). The backward sends the blocks the other
way (to r-1), each block's dK, dV summed so far following it one tick behind (so that it travels
while the next block is computed); after N ticks and one more hop every block's gradient is home.

    tick      0    1    2    3              backward:  0    1    2    3   then the dK,dV hop home
    rank 0    kv0  kv3  kv2  kv1                       kv0  kv1  kv2  kv3
    rank 1    kv1  kv0  kv3  kv2                       kv1  kv2  kv3  kv0
    rank 2    kv2  kv1  kv0  kv3                       kv2  kv3  kv0  kv1
    rank 3    kv3  kv2  kv1  kv0                       kv3  kv0  kv1  kv2

The merge (the online softmax): for one query, block b gives scores s_b, its max m_b and
l_b = sum exp(s_b - m_b), o_b = sum exp(s_b - m_b) v. With m = max(m_run, m_b), c = exp(m_run - m):
l_run <- c l_run + exp(m_b - m) l_b and o_run <- c o_run + exp(m_b - m) o_b; at the end
out = o_run / l_run and lse = m + log l_run, all the backward needs besides q, k, v and out.

The gpt is causal (--model gpt): query i sees keys 0..i, so a block of queries x keys is full, diagonal
(masked) or empty (skipped): RingAttention runs a plan of blocks (mp/cp/zigzag.py). --cp-layout zigzag (the
default) gives rank r chunks r and 2C-1-r of 2C, so that every rank computes as much as the next (contiguous:
rank r does r + 1 blocks); each token keeps its true position (docs/context_parallel.md).

What this adds to single_baseline.py, in order: RingAttention (forward and backward written out),
the all-to-all pair of Ulysses, the blocks on my tokens (attention, keyed dropouts, the vit head's
explicit all-reduce of the pooled mean), and train_step: the baseline's (the gpt's loss a piece:
piece_loss), with the gradients every rank's tokens gave each weight summed over the ranks before the norm.

    torchrun --standalone --nproc-per-node 2 context_parallel.py --data synthetic
    torchrun --standalone --nproc-per-node 4 context_parallel.py --data synthetic --attention ulysses --check
    torchrun --standalone --nproc-per-node 4 context_parallel.py --data synthetic --patch-size 2
    torchrun --standalone --nproc-per-node 4 context_parallel.py --model gpt --data synthetic --cp-layout zigzag
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from mp import checkpoint
from mp.check import check_and_exit, whole_model_step
from mp.cli import context_parallel_args
from mp.cp.blocks import ContextParallelEmbed, ContextParallelTokenEmbed, cp_rank, cp_size, sequence_run
from mp.cp.memory import SavedActivations
from mp.clipping import clip_global
from mp.data import agree_on_data, load_data, to_device
from mp.dist import distributed, exit_now, group_timeout
from mp.errors import note_one_rank
from mp.loop import Job, Replicas, Sums, evaluate, train, whole_model_run
from mp.mesh import Mesh
from mp.cp.zigzag import (WHOLE, AttentionWork, Layout, RunsDropout, gather_sequence, layout_of, ring_plan,
                          ulysses_plan)
from mp.loss import loss_function
from mp.models import Attention, LMHead, TokenEmbed, build_model, num_blocks
from mp.optim import make_optimizer
from mp.replicas import SummedGradients, average_replicated_grads, counted_once

PROGRAM = "context_parallel"


def parse_args(argv=None):
    args = context_parallel_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    checkpoint.validate(args)                     # the checkpoint to resume from, if any: whole, and of this run
    return args


# ----------------------------------------------------------------------------- the ring: point to point


def ring_neighbours(group):
    """(prev_rank, next_rank): the global ranks before and after me on the ring of the group."""
    ranks, me = dist.get_process_group_ranks(group), cp_rank(group)
    return ranks[(me - 1) % len(ranks)], ranks[(me + 1) % len(ranks)]


def ring_exchange(sends, frm, to, group):
    """Send each tensor of `sends` to `to` and receive one of the same shape from `frm` for each, all in
    one dist.batch_isend_irecv; returns the tensors that will land and the batch's works. One batch, in
    the same order on every rank (each send, then its receive): on nccl a send and a receive that cross
    between two ranks must share one group call, or both block (at 2 ranks `to` and `frm` are the same
    peer). Posted before the compute it should overlap; wait_all before reading what lands."""
    incoming = [torch.empty_like(block) for block in sends]
    ops = [op for block, got in zip(sends, incoming)
           for op in (dist.P2POp(dist.isend, block, to, group), dist.P2POp(dist.irecv, got, frm, group))]
    return incoming, dist.batch_isend_irecv(ops) if ops else []


def wait_all(works):
    for work in works:   # gloo: one work an operation; nccl: one for the whole batch
        work.wait()


# ----------------------------------------------------------------------------- ring attention


class RingAttention(torch.autograd.Function):
    """Exact softmax attention of my queries over every rank's keys and values, which pass round the
    ring; never more than one [T/N x T/N] block of scores at a time. q, k, v: [B, heads, T/N, head_dim].
    Saves q, k, v, the output and the log-sum-exp of each query (not the T x T probabilities): the
    backward recomputes each block's probabilities as exp(s - lse). A group of one (or None): the same
    attention on one block, with no communication (Ulysses' local attention)."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan, work):
        n, me, sqrt_d = cp_size(group), cp_rank(group), math.sqrt(q.shape[-1])   # scores: q.k / sqrt(head_dim)
        prev_rank, next_rank = ring_neighbours(group) if n > 1 else (None, None)
        kv = torch.stack([k, v])                                    # one message a tick, not two
        out = torch.zeros_like(q)                                   # the running sum of exp(s - m) v
        row_max = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)                         # the running sum of exp(s - m)
        for tick in range(n):
            if tick < n - 1:   # the next block (r - tick - 1's) is on its way while this one is computed
                (next_kv,), works = ring_exchange([kv], prev_rank, next_rank, group)
            # plan[s], s = the rank whose block I hold: the vit's one block, all my queries x all its keys; the
            # gpt's causal blocks (mp/cp/zigzag.py): a diagonal one masked, one whose keys all come after its
            # queries never computed
            for rows, cols, mask in plan[(me - tick) % n]:
                scores = q[..., rows, :] @ kv[0][..., cols, :].transpose(-2, -1) / sqrt_d   # this block only
                if mask is not None:
                    scores = scores.masked_fill(mask, -math.inf)
                if work is not None:                                   # the summary's attention_flops
                    work.add(q[..., rows, :], kv[0][..., cols, :])
                new_max = torch.maximum(row_max[..., rows], scores.amax(dim=-1))
                correction = torch.exp(row_max[..., rows] - new_max)   # rescale what was summed under the old max
                probs = torch.exp(scores - new_max.unsqueeze(-1))
                row_sum[..., rows] = row_sum[..., rows] * correction + probs.sum(dim=-1)
                out[..., rows, :] = out[..., rows, :] * correction.unsqueeze(-1) + probs @ kv[1][..., cols, :]
                row_max[..., rows] = new_max
            if tick < n - 1:
                wait_all(works)
                kv = next_kv
        out = out / row_sum.unsqueeze(-1)
        lse = row_max + torch.log(row_sum)                         # log of each query's softmax denominator
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan = group, plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, n, me, sqrt_d = ctx.group, cp_size(ctx.group), cp_rank(ctx.group), math.sqrt(q.shape[-1])
        prev_rank, next_rank = ring_neighbours(group) if n > 1 else (None, None)
        # dL/ds = P * (dL/dP - sum_j P_j dL/dP_j), and sum_j P_j dL/dP_j = sum_j P_j (dO . v_j) = dO . O
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        kv = torch.stack([k, v])
        # The blocks travel the other way round (to the previous rank, from the next), and each block's
        # dK, dV travels with it, one tick behind: at each tick a rank
        #   sends    the block it holds (on to the previous rank), and `done`: the dK, dV of the block it
        #            held last tick, summed over every rank that block has visited, mine included;
        #   receives the next block, and the sum so far of the block it holds now (the next rank held it
        #            last tick and sends its `done`);
        #   computes its part of the block it holds, which it adds to that sum when the batch is done.
        # Both transfers overlap the tick's compute; after the last tick, one hop takes each sum home.
        done = None
        for tick in range(n):
            sends = ([kv] if tick < n - 1 else []) + ([done] if tick > 0 else [])
            incoming, works = ring_exchange(sends, next_rank, prev_rank, group)
            mine = torch.zeros_like(kv)   # dK, dV of the block I hold: 0 where the plan skipped it
            for rows, cols, mask in ctx.plan[(me + tick) % n]:   # the blocks travel the other way now
                keys, values = kv[0][..., cols, :], kv[1][..., cols, :]
                scores = q[..., rows, :] @ keys.transpose(-2, -1) / sqrt_d
                if mask is not None:
                    scores = scores.masked_fill(mask, -math.inf)
                probs = torch.exp(scores - lse[..., rows].unsqueeze(-1))   # recomputed, exact (masked: 0)
                grad_scores = probs * (grad_out[..., rows, :] @ values.transpose(-2, -1) - delta[..., rows, :]) / sqrt_d
                grad_q[..., rows, :] += grad_scores @ keys
                mine[0][..., cols, :] += grad_scores.transpose(-2, -1) @ q[..., rows, :]
                mine[1][..., cols, :] += probs.transpose(-2, -1) @ grad_out[..., rows, :]
            wait_all(works)   # the transfers overlapped the compute above
            if tick < n - 1:
                kv, incoming = incoming[0], incoming[1:]
            done = mine if tick == 0 else incoming[0] + mine
        # the last hop: each block's gradient, complete, goes home (the previous rank held it last)
        (grad_kv,), works = ring_exchange([done], next_rank, prev_rank, group) if n > 1 else ((done,), [])
        wait_all(works)
        return grad_q, grad_kv[0], grad_kv[1], None, None, None


def ring_attention(q, k, v, group, layout=None, work=None):
    """layout (mp/cp/zigzag.py): which tokens each rank holds and, causal, which blocks it computes
    (None: the contiguous shards, every block whole)."""
    layout = layout or Layout(cp_size(group), q.shape[2] * cp_size(group))
    return RingAttention.apply(q, k, v, group, ring_plan(layout, cp_rank(group), q.device), work)


def local_attention(q, k, v, plan=WHOLE, work=None):
    """Attention over the tokens this rank holds, no communication: the ring's arithmetic on one block
    (so it saves lse, never a T x T matrix of probabilities); plan: that block's mask, if any."""
    return RingAttention.apply(q, k, v, None, plan, work)


# ----------------------------------------------------------------------------- Ulysses: two all-to-alls


def all_to_all(x, group):
    """x: [N, ...]; slice i goes to rank i, and slice i of the result came from rank i."""
    x = x.contiguous()         # first: empty_like copies x's strides, and the collective writes row-major
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def tokens_to_heads(x, group):
    """[..., heads, T/N, d] (all heads, my tokens) -> [..., heads/N, T, d] (my heads, all tokens)."""
    n, (*lead, heads, mine, d) = cp_size(group), x.shape
    parts = x.reshape(-1, n, heads // n, mine, d).transpose(0, 1)    # [N, batch, heads/N, T/N, d]
    got = all_to_all(parts, group)                 # part i went to rank i; got[j]: rank j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(*lead, heads // n, n * mine, d)


def heads_to_tokens(x, group):
    """[..., heads/N, T, d] (my heads, all tokens) -> [..., heads, T/N, d] (all heads, my tokens): the inverse."""
    n, (*lead, my_heads, tokens, d) = cp_size(group), x.shape
    parts = x.reshape(-1, my_heads, n, tokens // n, d).permute(2, 0, 1, 3, 4)   # [N, batch, heads/N, T/N, d]
    got = all_to_all(parts, group)                 # part i went to rank i; got[j]: my tokens of rank j's heads
    return got.transpose(0, 1).reshape(*lead, n * my_heads, tokens // n, d)


class _TokensToHeads(torch.autograd.Function):
    """Forward: tokens_to_heads; backward: heads_to_tokens (an all-to-all's conjugate is the inverse one)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tokens_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_tokens(grad, ctx.group), None


class _HeadsToTokens(torch.autograd.Function):
    """Forward: heads_to_tokens; backward: tokens_to_heads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return tokens_to_heads(grad, ctx.group), None


def ulysses_attention(q, k, v, group, layout=None, work=None):
    """One all-to-all takes q, k and v (stacked) to my h/N heads of all T tokens, attention runs there
    with no more communication, and a second all-to-all takes the output back to all heads of my tokens.
    The tokens arrive in rank order, each rank's in its layout's order: causal, the mask is built from
    their true positions (mp.cp.zigzag.ulysses_plan)."""
    q, k, v = _TokensToHeads.apply(torch.stack([q, k, v]), group)
    plan = ulysses_plan(layout, q.device) if layout is not None else WHOLE
    return _HeadsToTokens.apply(local_attention(q, k, v, plan, work), group)


ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}


# ----------------------------------------------------------------------------- the vit and the gpt on my tokens


class ContextParallelAttention(Attention):
    """mp.models.Attention with its whole weights, on my tokens: q, k, v and proj are per token; the
    attention between them is the ring's or Ulysses', over the layout (the gpt's: causal)."""

    def __init__(self, full, group, attention, layout=None, work=None):   # None: the vit's shards, uncounted
        nn.Module.__init__(self)   # not Attention.__init__: the layers are the full block's own
        self.q, self.k, self.v, self.proj, self.head_dim = full.q, full.k, full.v, full.proj, full.head_dim
        self.group, self.attention, self.layout, self.work = group, ATTENTION[attention], layout, work

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = self.attention(q, k, v, self.group, self.layout, self.work)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class _ReduceFromCP(torch.autograd.Function):
    """Forward all-reduce (sum the ranks' shares of the pooled mean); backward identity (the gradient of
    the sum with respect to each share is the sum's gradient, whole on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ContextParallelHead(nn.Module):
    """The head on my tokens: LayerNorm, my tokens' share of the mean over all T, summed over the ranks
    (explicitly: the only place the sequence is whole again), then the classifier on every rank."""

    def __init__(self, full, group, tokens):
        super().__init__()
        self.ln, self.fc, self.group, self.tokens = full.ln, full.fc, group, tokens   # Head's names

    def forward(self, x):
        share = self.ln(x).sum(dim=1) / self.tokens
        return self.fc(_ReduceFromCP.apply(share, self.group) if cp_size(self.group) > 1 else share)


def context_parallel_block(i, block, group, n_blocks, layout, attention, work):
    """Block i of the model, whole weights, made to run on my tokens (in place, same parameter names)."""
    runs = layout.runs(cp_rank(group))
    if isinstance(block, TokenEmbed):
        return ContextParallelTokenEmbed(block, layout.positions(cp_rank(group)))
    if isinstance(block, LMHead):
        return block   # per token: my tokens' logits, no pooling (the vit's head pools over all tokens)
    if i == 0:
        return ContextParallelEmbed(block, group)
    if i == n_blocks - 1:
        return ContextParallelHead(block, group, layout.tokens)
    block.attn = ContextParallelAttention(block.attn, group, attention, layout, work)
    # my tokens' masks: those of these tokens in the full layer, keyed by their true positions
    if len(runs) == 1:
        block.drop1.first_token = block.drop2.first_token = runs[0][0]
    else:   # the zigzag's two runs: a dropout each (mp.cp.zigzag.RunsDropout)
        block.drop1, block.drop2 = RunsDropout(block.drop1, runs), RunsDropout(block.drop2, runs)
    return block


def build_context_parallel_model(args, group, device):
    """The whole model on every rank (context parallelism shards activations, not weights), block by
    block from --seed, each block made to run on my tokens (mp/cp/zigzag.py: which, and where they sit)."""
    n_blocks, layout, work = num_blocks(args), layout_of(args, cp_size(group)), AttentionWork()
    model = build_model(args, lambda i, block: context_parallel_block(i, block, group, n_blocks, layout,
                                                                      args.attention, work), device)
    whole = {id(p) for p in model[n_blocks - 1].fc.parameters()} if args.model == "vit" else set()
    # every weight before the vit head's all-reduce saw my tokens only: its gradient is my tokens' share
    # (the gpt's head is per token: every weight's gradient is a share, the tied embedding's too)
    model.partial_grads = SummedGradients([p for p in model.parameters() if id(p) not in whole], group)
    model.saved_activations = SavedActivations(model)   # what the backward keeps of my tokens: the summary's
    model.attention_work = work                         # the attention each rank computes: the summary's
    model.layout, model.cp_rank = layout, cp_rank(group)
    return model


# ----------------------------------------------------------------------------- training


def sync_cp_grads(partial_sums, replicated):
    """Context parallelism's gradient synchronisation, once a step after the backward: the weights each
    rank applied to its own tokens (all but the classifier) hold that share of the gradient, summed
    over the ranks (not averaged: the loss is already the mean over all tokens' pooled logits); the
    classifier's is whole on every rank already. On a GPU it is averaged too (replicated is not None):
    its kernels may sum in another order from run to run, and a last-bit difference would let the
    ranks' copies drift apart; on the CPU the copies are bit-identical, and the all-reduce is skipped
    (mp.replicas.ReplicatedGrads)."""
    partial_sums.sum()
    if replicated:
        replicated.average()


def piece_loss(args, data, step, model):
    """loss(my logits, the batch's targets). The vit's logits are whole on every rank: the batch's mean. The
    gpt's are my tokens': their cross-entropies summed over the GLOBAL batch's valid count N (mp.loss: pieces
    1, the ranks' gradients are summed, not averaged; my own count would be wrong, Megatron PR #7513)."""
    loss_fn = loss_function(args, data, step)
    if args.model != "gpt":
        return loss_fn
    return lambda logits, y: loss_fn(logits, model.layout.take(y, model.cp_rank))   # my tokens' targets


def train_step(step, model, optimizer, data, args, device, cp_grads, norm):
    """One optimizer step of single_baseline.py's, on my tokens: the same order, the ring (or the
    all-to-alls) inside attention, the vit head's all-reduce, and the partial gradients summed before the
    norm. The vit's logits are whole on every rank, the gpt's loss is a piece (mp.loop.Sums adds them up)."""
    x, y = (to_device(t, device) for t in data.batch(step, args.batch_size))   # the whole batch, on every rank
    optimizer.zero_grad(set_to_none=True)
    loss_fn = piece_loss(args, data, step, model)
    with model.dropout_keys.training(step), model.saved_activations.counting(), model.attention_work.counting():
        loss = loss_fn(model(x), y)   # attention's communication runs inside the model
    loss.backward()
    sync_cp_grads(*cp_grads)
    grad_norm = clip_global(model.parameters(), args.clip_grad_norm, *norm)   # the full model's norm
    optimizer.step()
    return loss.detach(), grad_norm   # tensors: the loop reads them every --log-every steps


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("context parallelism of degree 1, the whole sequence on one rank")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        # the one mesh (mp/mesh.py) with every rank on its cp axis: the ring and the all-to-alls run on its cp group
        mesh = Mesh.build(env.rank, env.world_size, cp=env.world_size, timeout=group_timeout(env, args.timeout_s))
        group = mesh.cp_group
        model = build_context_parallel_model(args, group, env.device)
        cp_grads = (model.partial_grads, average_replicated_grads(model, group, env.device))
        # every weight is whole on every rank after the sum: cp rank 0 counts them all in the norm
        norm = ([group], counted_once(model, group))
        if args.check:
            x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
            return check_and_exit(env, args, f"context parallelism --attention {args.attention}", model,
                                  check_step(model, cp_grads, piece_loss(args, data, 0, model), group), x, y,
                                  norm=norm, loss_fn=loss_function(args, data, 0))
        optimizer = make_optimizer(model.parameters(), args)

        def step(k):
            return train_step(k, model, optimizer, data, args, env.device, cp_grads, norm)

        # the loop (mp/loop.py) runs the steps, logs (cp rank 0 owns the loss), evaluates (every rank: attention
        # communicates), saves, and at the end checks that the weights stayed bit-identical on every rank
        layout = checkpoint.layout_of(PROGRAM, env, cp=env.world_size, attention=args.attention,
                                      **({"cp_layout": args.cp_layout} if args.model == "gpt" else {}))
        # the gpt's loss is a piece on each rank (its tokens'), summed for the log; its logits too, gathered
        sums = Sums(norm_groups=[group], pieces=group if args.model == "gpt" else None)
        run = sequence_run(model, env.device, group) if args.model == "gpt" else whole_model_run(model, env.device)
        replicas = Replicas(list(model.parameters()), group, "weights bit-identical across the "
                            f"{env.world_size} context-parallel ranks")
        return train(args, env, Job(step, model, optimizer, layout, owner=env.rank == 0, sums=sums,
                                    evaluate=lambda: evaluate(data, env.device, run),
                                    collectives="the context-parallel exchanges", replicas=[replicas]))


def check_step(model, cp_grads, loss_fn, group):
    """--check's step (mp.check): forward and backward on the first batch, then the gradients summed; the
    gpt's logits gathered whole and its loss's pieces summed, to compare with the full model's."""
    def step(x, y):
        logits, loss = whole_model_step(model, loss_fn)(x, y)
        sync_cp_grads(*cp_grads)
        if model.layout.causal:
            logits, loss = gather_sequence(logits.detach(), model.layout, group), loss.detach().clone()
            dist.all_reduce(loss, group=group)
        return logits, loss
    return step


if __name__ == "__main__":
    exit_now(main())  # everything is written and torn down: skip gloo's destructors (mp.dist.exit_now)
