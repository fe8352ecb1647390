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

The load-balancing loss of Switch Transformers, E * sum_i f_i * P_i, is 1 when the load is even: f_i is the
fraction of the routed (token, slot) pairs that chose expert i (counted, no gradient), P_i the mean router
probability of expert i (its gradient pushes the router toward the experts with less load). With K > 1, f_i
counts every slot, as Megatron-LM does (GShard's counts first choices only). Each block adds it times
--aux-loss to the training loss (training_loss).

One read of the device a block a forward, and only one: split() and the all-to-all take their sizes as
Python ints, so how many rows each expert runs (kept_counts, summed over the slots) is read back; the rest
(the counts, the capacity's order, which choices are kept, the sort by expert) stays on the device, and the
capacity comes from the number of tokens, which the host knows. The routing record stays on the device too,
until the loop logs (LoadRecord).

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
    """[K, E]: how many tokens chose each expert as their k-th choice. A scatter of ones, not bincount:
    on a GPU, bincount reads the largest value back to size its output."""
    counts = torch.zeros(choice.shape[1], experts, dtype=torch.long, device=choice.device)
    return counts.scatter_add_(1, choice.T, torch.ones_like(choice.T))


def capacity_of(tokens, experts, top_k, capacity_factor):
    """The most tokens one expert runs: ceil(C * K * tokens / E), tokens the number in the global batch
    (a Python int: the host knows it without asking the device); None: dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * top_k * tokens / experts)


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


def rows_per_expert(kept):
    """[N][E] Python ints: how many of rank n's choices expert e runs (kept, summed over the slots). The one
    read of the device a mixture of experts makes a forward: split() and all_to_all_single take their sizes
    as ints (tests/count_reads.py knows it by this name)."""
    return kept.sum(dim=1).tolist()


def sorted_by_expert(keep, choice, experts, kept):
    """(token, slot) of the kept choices, grouped by expert; within an expert in the tokens' order. kept:
    how many choices are kept, a Python int (from the one read). Every choice is sorted, a dropped one
    under the key E, past every expert, and the first `kept` are taken: keep.nonzero() would have to read
    its length back from the device."""
    top_k = choice.shape[1]
    key = torch.where(keep, choice, experts).flatten()          # (token 0, slot 0), (token 0, slot 1), ...
    order = torch.argsort(key, stable=True)[:kept]               # stable: in each expert, the tokens' order
    return order // top_k, order % top_k


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
    """What the router did in each training step: the tokens that chose each expert (all slots, before
    capacity) and the choices dropped over capacity. The steps since the loop last logged stay on the
    device, one row [routed per expert..., dropped] a step in one buffer written in place (it doubles only
    until the first log, so nothing grows with the run); read_load moves them to the host lists."""

    def __init__(self):
        self.window, self.rows, self.last_step = None, 0, None
        self.routed, self.dropped = [], []          # on the host, a step each: [E] ints, an int

    def add(self, step, counts, kept):
        row = torch.cat([counts.sum(dim=(0, 1)), (counts - kept).sum().view(1)])
        if step == self.last_step and self.rows:    # another microbatch of the same step: its load adds up
            self.window[self.rows - 1] += row
            return
        if self.window is None or self.rows == len(self.window):
            grown = row.new_zeros(max(16, 2 * self.rows), len(row))
            if self.rows:
                grown[:self.rows] = self.window
            self.window = grown
        self.window[self.rows] = row
        self.rows, self.last_step = self.rows + 1, step


class MixtureOfExperts(nn.Module):
    """The block's MLP as E experts behind a router, in one process (expert_parallel.py's ExpertParallelMoE
    runs the same arithmetic with the experts spread over the ranks)."""
    recompute = False   # parallel_5d.py --recompute sets it: each microbatch's forward runs twice (rerun)

    def __init__(self, dim, experts, top_k, capacity_factor, aux_weight, act, keys):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(expert_mlp(dim, act) for _ in range(experts))
        self.num_experts, self.top_k, self.capacity_factor, self.aux_weight = experts, top_k, capacity_factor, aux_weight
        self.keys, self.load, self.aux_loss = keys, LoadRecord(), None
        self.microbatches = 1    # single_baseline.py --microbatches M: a training batch routed as M microbatches

    def forward(self, x):
        """x: [B, T, H]. In a training step with microbatches = M > 1, microbatch m (samples m*B/M ..
        (m+1)*B/M - 1) is routed on its own, with its own f_i, capacity and order, as a pipeline routes
        the microbatch it runs; the load-balancing loss is their mean (each microbatch's loss weighs 1/M)."""
        if self.microbatches == 1 or self.training_step is None:
            return self.route_and_run(x)
        outputs, shares = [], []
        for part in x.chunk(self.microbatches):
            outputs.append(self.route_and_run(part))
            shares.append(self.aux_loss)
        self.aux_loss = torch.stack(shares).mean()
        return torch.cat(outputs)

    def route_and_run(self, x):
        """Route the tokens of x [B, T, H] (their f_i, capacity and order those of x), run the experts, combine."""
        b, t, h = x.shape
        x = x.reshape(b * t, h)
        probs, weights, choice = route(self.router, x, self.top_k)
        counts = slot_counts(choice, self.num_experts)[None]               # [1, K, E]: one rank
        capacity = capacity_of(b * t, self.num_experts, self.top_k, self.capacity_factor)
        kept = kept_counts(counts, capacity)
        self.record(probs, counts, kept)
        sizes = rows_per_expert(kept)[0]             # the one read: each expert's rows, for split()
        keep = kept_mask(choice, counts, 0, capacity)
        token, slot = sorted_by_expert(keep, choice, self.num_experts, sum(sizes))
        y = torch.cat([run(chunk) for run, chunk in zip(self.experts, x[token].split(sizes))])
        return combine(y, token, slot, weights, b * t).view(b, t, h)

    @property
    def training_step(self):
        """The step being trained, None in an evaluation's forward (the loop sets it on the model's dropout
        keys, mp.dropout.DropoutKeys, which every block shares)."""
        return None if self.keys is None else self.keys.step

    def record(self, probs, counts, kept):
        """This forward's share of the load-balancing loss, and in a training step the load of each expert
        (the routing record the summary logs)."""
        self.aux_loss = aux_loss_share(probs, counts, self.aux_weight)
        if self.training_step is not None and not self.rerun:
            self.load.add(self.training_step, counts, kept)

    @property
    def rerun(self):
        """This forward is --recompute's second one of a microbatch (in its backward, autograd on; the first ran
        without): it routes the same tokens the same way, so only its load-balancing loss's graph is new, and
        the routing record and the logged loss keep the first's."""
        return self.recompute and torch.is_grad_enabled()


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


def read_load(model):
    """Moves the routing record of the steps since the last call from the device to the host, one read for
    every block (none for a dense model). The loop calls it when it logs, on every rank."""
    loads = [m.load for m in moe_layers(model) if m.load.rows]
    if not loads:
        return
    rows = torch.cat([load.window[:load.rows] for load in loads]).tolist()
    for load in loads:
        steps, rows = rows[:load.rows], rows[load.rows:]
        load.routed += [row[:-1] for row in steps]
        load.dropped += [row[-1] for row in steps]
        load.rows = 0


def expert_load(model):
    """The summary's routing record: per training step, [block][expert] the tokens routed and the choices
    dropped over capacity, summed over the blocks (None: a dense model)."""
    read_load(model)
    layers = [m.load for m in moe_layers(model)]
    if not layers or not layers[0].routed:
        return None
    routed = [list(blocks) for blocks in zip(*(load.routed for load in layers))]      # [steps][blocks][E]
    dropped = [sum(blocks) for blocks in zip(*(load.dropped for load in layers))]
    return {"tokens_per_expert": routed, "dropped_per_step": dropped}
