"""A mixture of experts in place of the vit's feed-forward block (--experts E): a learned router sends each
token to its top K experts, each the block's own two-layer MLP, and adds their outputs weighted by the router.

    route      probs = softmax(x W_r) over the E experts; the top K; K = 1: the weight is the top
               probability (Switch), K = 2: the two renormalised to sum to 1 (GShard)
    count      how many tokens each expert got, per slot (a token's first choice, its second)
    capacity   --capacity-factor C: an expert runs at most ceil(C * K * tokens / E) of them, first every
               token's first choice, then the second choices, each in the order of the tokens in the batch;
               the rest are dropped (the token passes through the block's residual). Default: dropless
    experts    expert e runs its tokens, all at once
    combine    each token's output: the sum of its kept experts' outputs times their router weights

The load-balancing loss of Switch and GShard, E * sum_i f_i * P_i, is 1 when the load is even: f_i is the
fraction of the routed (token, slot) pairs that chose expert i (counted, no gradient), P_i the mean router
probability of expert i (its gradient pushes the router toward the experts with less load). Each block
adds it times --aux-loss to the training loss (training_loss).

Every function below takes the counts of every rank, [N, K, E] (one process: N = 1), so that
expert_parallel.py, which routes its slice of the batch and runs E/N experts on tokens from every rank,
computes the baseline's numbers: the global batch's f_i, its capacity and which tokens it drops.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def expert_mlp(dim, act):
    """One expert: the dense block's MLP, Linear(H, 2H), act, Linear(2H, H)."""
    return nn.Sequential(nn.Linear(dim, 2 * dim), act(), nn.Linear(2 * dim, dim))


def route(router, x, top_k):
    """(probs [T, E], weights [T, K], choice [T, K]) of the tokens x [T, H]."""
    probs = router(x).softmax(dim=-1)
    weights, choice = probs.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, choice


def slot_counts(choice, experts):
    """[K, E]: how many tokens chose each expert as their k-th choice."""
    return torch.stack([torch.bincount(c, minlength=experts) for c in choice.unbind(dim=1)])


def capacity_of(counts, top_k, capacity_factor):
    """The most tokens one expert runs: ceil(C * K * tokens / E) of the global batch (None: dropless)."""
    if capacity_factor is None:
        return None
    tokens = int(counts[:, 0].sum())          # every token has exactly one first choice
    return math.ceil(capacity_factor * top_k * tokens / counts.shape[-1])


def ahead_of(counts):
    """[N, K, E]: for rank n's k-th choices of expert e, how many (token, slot) pairs of that expert come
    first in the global order (every rank's first choices, in rank order, then every rank's second ...)."""
    n, k, e = counts.shape
    flat = counts.transpose(0, 1).reshape(k * n, e)                  # slot-major, then rank: the global order
    return (flat.cumsum(dim=0) - flat).reshape(k, n, e).transpose(0, 1)


def kept_counts(counts, capacity):
    """[N, K, E]: how many of each rank's k-th choices of each expert its capacity runs."""
    if capacity is None:
        return counts
    return (capacity - ahead_of(counts)).clamp(min=0).minimum(counts)


def kept_mask(choice, counts, rank, capacity):
    """Bool [T, K]: which of my tokens' choices are within their expert's capacity (my counts: counts[rank])."""
    if capacity is None:
        return torch.ones_like(choice, dtype=torch.bool)
    experts, ahead = counts.shape[-1], ahead_of(counts)[rank]              # [K, E]
    keep = []
    for k, c in enumerate(choice.unbind(dim=1)):
        one_hot = F.one_hot(c, experts)
        mine_before = (one_hot.cumsum(dim=0) - one_hot).gather(1, c[:, None])[:, 0]   # my earlier tokens, same expert
        keep.append(ahead[k][c] + mine_before < capacity)
    return torch.stack(keep, dim=1)


def sorted_by_expert(keep, choice):
    """(token, slot, expert) of the kept choices, grouped by expert; within an expert in the tokens' order."""
    token, slot = keep.nonzero(as_tuple=True)
    expert = choice[token, slot]
    order = torch.argsort(expert, stable=True)
    return token[order], slot[order], expert[order]


def aux_loss_share(probs, counts, weight):
    """weight * E * sum_i f_i * P_i, with P_i's sum over my tokens only: the ranks' shares add up to the loss
    of the global batch (f_i from every rank's counts), and each share's gradient is exact for my tokens."""
    experts, top_k = counts.shape[-1], counts.shape[1]
    tokens = counts[:, 0].sum()
    f = counts.sum(dim=(0, 1)).to(probs.dtype) / (tokens * top_k)
    return weight * experts * (f * probs.sum(dim=0)).sum() / tokens


def combine(y, token, slot, weights, tokens):
    """[tokens, H]: each token's kept experts' outputs y (one row per kept choice) times their weights, summed."""
    return torch.zeros(tokens, y.shape[-1], dtype=y.dtype, device=y.device).index_add(
        0, token, y * weights[token, slot][:, None])


class LoadRecord:
    """What the router did in each training step, kept on the device and read once at the end of the run:
    the tokens that chose each expert (all slots, before capacity) and the choices dropped."""

    def __init__(self):
        self.routed, self.dropped = [], []

    def add(self, counts, kept):
        self.routed.append(counts.sum(dim=(0, 1)))
        self.dropped.append((counts - kept).sum())


class MixtureOfExperts(nn.Module):
    """The block's MLP as E experts behind a router, in one process (expert_parallel.py's ExpertParallelMoE
    runs the same arithmetic with the experts spread over the ranks)."""

    def __init__(self, dim, experts, top_k, capacity_factor, aux_weight, act, keys):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(expert_mlp(dim, act) for _ in range(experts))
        self.num_experts, self.top_k, self.capacity_factor, self.aux_weight = experts, top_k, capacity_factor, aux_weight
        self.keys, self.load, self.aux_loss = keys, LoadRecord(), None

    def forward(self, x):
        b, t, h = x.shape
        x = x.reshape(b * t, h)
        probs, weights, choice = route(self.router, x, self.top_k)
        counts = slot_counts(choice, self.num_experts)[None]               # [1, K, E]: one rank
        self.note(probs, counts)
        keep = kept_mask(choice, counts, 0, capacity_of(counts, self.top_k, self.capacity_factor))
        token, slot, expert = sorted_by_expert(keep, choice)
        chunks = x[token].split(torch.bincount(expert, minlength=self.num_experts).tolist())
        y = torch.cat([run(chunk) for run, chunk in zip(self.experts, chunks)])
        return combine(y, token, slot, weights, b * t).view(b, t, h)

    def note(self, probs, counts):
        """This forward's share of the load-balancing loss; in training, the load of each expert."""
        self.aux_loss = aux_loss_share(probs, counts, self.aux_weight)
        if self.keys is not None and self.keys.step is not None:
            self.load.add(counts, kept_counts(counts, capacity_of(counts, self.top_k, self.capacity_factor)))


def moe_layers(model):
    return [m for m in model.modules() if hasattr(m, "aux_loss") and hasattr(m, "load")]


def aux_loss(model):
    """The load-balancing losses of the model's last forward, summed over its blocks (None: a dense model)."""
    losses = [m.aux_loss for m in moe_layers(model)]
    return torch.stack(losses).sum() if losses else None


def plus_aux_loss(model, loss):
    """The loss the baseline minimises: the cross-entropy `loss`, plus the load-balancing loss of a mixture
    of experts' last forward (a dense model's: `loss` itself, bit for bit)."""
    aux = aux_loss(model)
    return loss if aux is None else loss + aux


def expert_load(model):
    """The summary's routing record: per training step, [block][expert] the tokens routed and the choices
    dropped over capacity, summed over the blocks (None: a dense model); one read from the device."""
    layers = [m.load for m in moe_layers(model)]
    if not layers or not layers[0].routed:
        return None
    routed = torch.stack([torch.stack(load.routed) for load in layers], dim=1)      # [steps, blocks, E]
    dropped = torch.stack([torch.stack(load.dropped) for load in layers], dim=1).sum(dim=1)
    return {"tokens_per_expert": routed.tolist(), "dropped_per_step": dropped.tolist()}
