"""The exact counts of this project's programs, from their own flags: what each rank holds between steps
(param_mb, grad_mb, optimizer_state_mb) and what it sends a step over each group (the summary's
sent_mb_per_step, dp_sent_mb_per_step and all_to_all_mb_per_step), equal to what a run's summary record
counts (tests/test_plan.py holds a dozen runs' records, tests/test_plan_runs.py launches more: every field).

How a rank's share is found, the way the programs build it:
    1. its coordinates on the mesh, rank = ((dp * pp + pp_rank) * cp + cp_rank) * tp + tp_rank (mp/mesh.py);
    2. its chunks of blocks: the blocks split evenly (or by --balance) into pp x virtual stages chunks,
       chunk c of rank r is virtual stage c*p + r (zbv: r and 2p-1-r; mp.pp.schedules.virtual_stage);
    3. its slice of each block's parameters (tp: columns/rows by whole heads; ep: its E/N experts).
Then the data-parallel gradients in buckets as mp.buckets lays them (mp/plan/buckets.py: the parameters in
backward order, cut at the same sizes, padded to a multiple of the group's size when sharded), and each
collective's bytes as mp/traffic.py counts them: all-reduce 2(n-1)/n of the tensor, reduce-scatter (n-1)/n,
all-gather (n-1) x my part, an isend its tensor. On gloo (the CPU) a reduce-scatter is an all-reduce in place
and an all-gather n broadcasts (mp/dp_collectives.py): the same result, the bytes of an all-reduce; nccl sends
the halves.
"""
from dataclasses import dataclass

from mp.plan.buckets import FLOAT, MB, bucket_groups, bucket_traffic, optimizer_bytes, padded
from mp.plan.model import NUM_CLASSES, block_params, from_args
from mp.pp.schedules import stage_owner, virtual_stage
from mp.sizes import split_sizes


@dataclass
class Grid:
    """The mesh of one run: the sizes of its axes and which group syncs the dense and the expert gradients."""
    world: int
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    dense_sync: str = None    # the group the dense gradients are averaged over ("dp", "dp_cp", "cp", None)
    flat: bool = False        # one all-reduce of every dense gradient at once, no buckets (context_parallel.py,
                              # expert_parallel.py): grad_mb is param_mb, the summary has no dp_sent_mb_per_step

    def coords(self, rank):
        """(dp, pp, cp, tp) coordinates of a global rank: arange(world).view(dp, pp, cp, tp)."""
        rank, t = divmod(rank, self.tp)
        rank, c = divmod(rank, self.cp)
        d, p = divmod(rank, self.pp)
        return d, p, c, t

    def sync_size(self):
        """Ranks in the group my dense gradients are averaged over (1: none)."""
        return {"dp": self.dp, "dp_cp": self.dp * self.cp, "cp": self.cp, "ep": self.ep}.get(self.dense_sync, 1)

    def ep_rank(self, rank):
        """My place in my ep group: consecutive ranks of the stage's (dp, cp, tp) order (mp.mesh.lines)."""
        d, _, c, t = self.coords(rank)
        return ((d * self.cp + c) * self.tp + t) % self.ep


def grid_of(program, args, world):
    """The mesh each program lays its ranks on (its parse_args already checked that it tiles)."""
    if program == "pipeline_microbatch":
        return Grid(world, pp=world)
    if program == "pipeline_dp_joint":
        return Grid(world, dp=args.dp, pp=world // args.dp, dense_sync="dp")
    if program == "tensor_parallel":
        return Grid(world, tp=world)
    if program == "parallel_3d":
        return Grid(world, dp=args.dp, tp=args.tp, pp=world // (args.dp * args.tp), dense_sync="dp")
    if program == "context_parallel":
        return Grid(world, cp=world, dense_sync="cp", flat=True)
    if program == "expert_parallel":   # its one group of every rank is named ep (mp.traffic keeps the first name)
        return Grid(world, dp=world, ep=world, dense_sync="ep", flat=True)
    if program == "parallel_5d":
        return Grid(world, dp=args.dp, cp=args.cp, tp=args.tp, ep=args.ep,
                    pp=world // (args.dp * args.cp * args.tp), dense_sync="dp_cp")
    return Grid(world)


def chunk_blocks(args, m, pp):
    """The block indices of each virtual stage (--balance, or the even split)."""
    chunks = pp * getattr(args, "virtual_stages", 1)
    balance = getattr(args, "balance", None)
    sizes = [int(b) for b in balance.split(",")] if balance and balance != "auto" else split_sizes(m.blocks(), chunks)
    starts = [sum(sizes[:i]) for i in range(chunks)]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


def my_blocks(args, m, grid, pp_rank):
    """The blocks of my chunks, in chunk order (mp.pp: chunk c of pp rank r is virtual stage virtual_stage(c, r))."""
    per_chunk = chunk_blocks(args, m, grid.pp)
    placement = "v" if getattr(args, "schedule", "") == "zbv" else "loop"
    return [per_chunk[virtual_stage(c, pp_rank, grid.pp, placement)]
            for c in range(getattr(args, "virtual_stages", 1))]


def tied_copy(m, grid, rank, args):
    """Elements of the tied embedding's copy on the stage that holds the head but not block 0 (mp.pp.tied's
    TiedCopy, "0.tok.weight", registered first: block 0's place), my tp rank's vocabulary rows; 0 elsewhere."""
    if m.kind != "gpt" or not m.tied:
        return 0
    _, p, _, t = grid.coords(rank)
    blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
    if 0 in blocks or m.blocks() - 1 not in blocks:
        return 0
    return next(q for q in block_params(m, 0, grid.tp) if q.name == "tok.weight").numel(grid.tp, t)


def embed_sent(m, grid, rank, args):
    """The tied weight's gradient summed over the mesh's embed group (mp.pp.tied), once a step, where the first
    and the last stage are two ranks: an all-reduce of my vocabulary rows between those two."""
    if m.kind != "gpt" or not m.tied or grid.pp == 1:
        return 0
    placement = "v" if getattr(args, "schedule", "") == "zbv" else "loop"
    if stage_owner(grid.pp * getattr(args, "virtual_stages", 1) - 1, grid.pp, placement)[0] == 0:
        return 0          # zbv's V: rank 0 holds both ends, one Parameter
    _, p, _, t = grid.coords(rank)
    blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
    if 0 not in blocks and m.blocks() - 1 not in blocks:
        return 0
    return next(q for q in block_params(m, 0, grid.tp) if q.name == "tok.weight").numel(grid.tp, t) * FLOAT


def late_indices(m, grid, rank, args):
    """Where my dense parameters (rank_params' order) hold the tied weight, whose gradient the buckets take after
    the embed group's sum (mp.pp.tied's late): the copy first on the head's stage, block 0's second (after pos)."""
    if m.kind != "gpt" or not m.tied or program_of(args) not in ("pipeline_dp_joint", "parallel_3d", "parallel_5d"):
        return ()
    _, p, _, _ = grid.coords(rank)
    blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
    return (1,) if 0 in blocks else (0,) if tied_copy(m, grid, rank, args) else ()


def hybrid_blocks(m, args):
    """tensor_parallel.py --hybrid: the cnn's convolutions whole on every rank (data-parallel over tp)."""
    return (0, 1) if m.kind == "cnn" and getattr(args, "hybrid", False) else ()


def rank_params(m, grid, rank, args):
    """(dense, expert): my parameters' element counts, each list in registration order."""
    _, p, _, t = grid.coords(rank)
    experts = range(grid.ep_rank(rank) * m.experts // grid.ep, (grid.ep_rank(rank) + 1) * m.experts // grid.ep)
    copy = tied_copy(m, grid, rank, args)
    dense, expert = [copy] if copy else [], []
    for chunk in my_blocks(args, m, grid, p):
        for i in chunk:
            for q in block_params(m, i, grid.tp):
                if q.expert is None:
                    dense.append(q.numel(grid.tp, t) if i not in hybrid_blocks(m, args) else q.numel())
                elif q.expert in experts:
                    expert.append(q.numel())
    return dense, expert


def holdings(m, grid, rank, args, backend):
    """What the rank holds between steps and sends over dp (dp_cp, edp) a step: {field: bytes} and {group: bytes}."""
    dense, expert = rank_params(m, grid, rank, args)
    sync = grid.sync_size()
    edp = grid.dp * grid.cp * grid.tp // grid.ep
    zero, opt = getattr(args, "zero", 0), getattr(args, "optimizer", "sgd")
    gather, bucket_mb = getattr(args, "zero3_gather", None), getattr(args, "bucket_mb", None)
    out = {"param": 0, "grad": 0, "state": 0, "dp_ring": 0}
    sent = {}
    for name, sizes, n in (("dense", dense, sync), ("expert", expert, edp)):
        if not sizes:
            continue
        if grid.dense_sync is None or grid.flat:         # no buckets: autograd's own gradients
            out["param"] += sum(sizes) * FLOAT
            out["grad"] += sum(sizes) * FLOAT
            out["state"] += optimizer_bytes(sizes, opt, args.momentum)
            if grid.flat and name == "dense" and n > 1:   # the vit's classifier runs after the cp sum: whole, equal
                synced = sum(sizes) - (head_fc(m) if program_of(args) == "context_parallel" and m.kind == "vit" else 0)
                sent[grid.dense_sync] = 2 * (n - 1) * (synced * FLOAT) // n
            continue
        blocks = block_sizes(m, grid, rank, args, expert=name == "expert") if zero == 3 else None
        late = late_indices(m, grid, rank, args) if name == "dense" else ()
        if zero == 3 and late == (0,):   # a block a bucket: the copy is in the head's, my last block
            late = (sum(len(b) for b in blocks[:-1]),)
        groups = bucket_groups(sizes, zero, bucket_mb, blocks, late)
        buckets = [padded(sum(g), n) if zero else sum(g) for g, _ in groups]
        slices = [b // n for b in buckets] if zero else sizes
        out["param"] += (sum(slices) if zero == 3 else sum(sizes)) * FLOAT
        out["grad"] += (sum(slices) if zero >= 2 else sum(buckets)) * FLOAT
        out["state"] += optimizer_bytes(slices, opt, args.momentum)
        ring, metered = bucket_traffic(buckets, n, zero, args.microbatches_per_replica, gather, backend,
                                       [is_late for _, is_late in groups])
        out["dp_ring"] += ring if name == "dense" else 0    # the summary's dp_sent: the dense buckets' alone
        group = {"dense": grid.dense_sync, "expert": "edp"}[name]
        if n > 1:
            sent[group] = sent.get(group, 0) + metered
    if getattr(args, "schedule", "") == "2bw":   # PipeDream-2BW (mp.pp.pipedream): two weight versions held,
        out["param"] *= 2                        # and the older one's gradient let go with its update (the
        out["grad"] = 0                          # summary's grad_mb, after the step, finds none)
    return out, sent


def block_sizes(m, grid, rank, args, expert=False):
    """--zero 3's buckets: my element counts per block (dense or my experts), in registration order."""
    _, p, _, t = grid.coords(rank)
    e0 = grid.ep_rank(rank) * m.experts // grid.ep
    mine = range(e0, e0 + m.experts // max(grid.ep, 1))
    copy = tied_copy(m, grid, rank, args) if not expert else 0
    out = []
    for chunk in my_blocks(args, m, grid, p):
        for i in chunk:
            ps = block_params(m, i, grid.tp)
            out.append([q.numel(grid.tp, t) for q in ps if q.expert is None] if not expert else
                       [q.numel() for q in ps if q.expert in mine])
            if copy and i == m.blocks() - 1:   # the tied copy is the head's own weight, listed first (LMHead)
                out[-1].insert(0, copy)
    return out


# ----------------------------------------------------------------------------- activations' messages: pp, tp, cp, ep


def cut_numel(m, block, samples, tokens):
    """Elements of the activation after `block` (what a pipeline sends across a cut after it)."""
    if m.kind == "cnn":
        return samples * (6 * 14 * 14, 16 * 5 * 5, 120, 84)[block]
    if m.kind == "mlp":
        return samples * m.hidden
    return samples * tokens * m.hidden


def microbatches(program, args):
    """M: the microbatches each replica's step runs (one where the program has no pipeline)."""
    return getattr(args, "microbatches", 1) if program in PIPELINES else 1


PIPELINES = ("pipeline_microbatch", "pipeline_dp_joint", "parallel_3d", "parallel_5d")


def pp_sent(m, grid, rank, args, samples, tokens, program):
    """Bytes my pipeline rank sends a step: each microbatch's activation forward across every cut after one of
    my chunks, its gradient backward across every cut before one (the first chunk's input needs none).
    parallel_3d/5d's scatter-gather: a cut whole on every tp rank goes 1/tp from each (the rest: tp's)."""
    if grid.pp == 1 and getattr(args, "virtual_stages", 1) == 1:
        return 0, 0
    per_chunk = chunk_blocks(args, m, grid.pp)
    _, p, _, _ = grid.coords(rank)
    placement = "v" if getattr(args, "schedule", "") == "zbv" else "loop"
    mine = [virtual_stage(c, p, grid.pp, placement) for c in range(getattr(args, "virtual_stages", 1))]
    M, sent, gathered = microbatches(program, args), 0, 0
    split = grid.tp if program in ("parallel_3d", "parallel_5d") and getattr(args, "scatter_gather", False) \
        and not getattr(args, "sequence_parallel", False) and m.kind in ("vit", "gpt") else 1
    # under sequence parallelism the cut is already my 1/t of the tokens: sent as it is, nothing to gather
    sharded = grid.tp if program in ("parallel_3d", "parallel_5d") and getattr(args, "sequence_parallel", False) \
        and m.kind in ("vit", "gpt") else 1
    for v in mine:
        n = cut_numel(m, per_chunk[v][-1], samples, tokens)
        # a cut between two chunks of the same rank (zbv's tip of the V) is no message
        if v < len(per_chunk) - 1 and stage_owner(v + 1, grid.pp, placement)[0] != p:
            sent += M * n * FLOAT // (split * sharded)
            gathered += M * (split - 1) * (n * FLOAT // split)
        if v > 0 and stage_owner(v - 1, grid.pp, placement)[0] != p:
            n = cut_numel(m, per_chunk[v - 1][-1], samples, tokens)
            sent += M * n * FLOAT // (split * sharded)
            gathered += M * (split - 1) * (n * FLOAT // split)
    return sent, gathered


def tp_sent(m, grid, rank, args, samples, tokens, program):
    """Bytes my tp rank sends a step inside the layers: each transformer block's f and g, all-reduces of the
    [b, s, h] activation, two forward (after attention's proj and the MLP's fc2) and two backward (attention's
    and the MLP's input gradients); --recompute runs the forward twice."""
    if grid.tp == 1:
        return 0
    _, p, _, _ = grid.coords(rank)
    if m.kind not in ("vit", "gpt"):
        blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
        return small_tp_sent(m, blocks, samples, grid.tp, grid.coords(rank)[3], args) * microbatches(program, args) \
            + hybrid_sync(m, grid.tp, args)
    layers = sum(1 for chunk in my_blocks(args, m, grid, p) for i in chunk if 0 < i < m.blocks() - 1)
    full, t, M = samples * tokens * m.hidden * FLOAT, grid.tp, microbatches(program, args)
    calls = 4 + (2 if getattr(args, "recompute", False) else 0)
    blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
    ends = gpt_ends(m, blocks, samples, tokens, t, getattr(args, "sequence_parallel", False)) * M
    if not getattr(args, "sequence_parallel", False):
        if m.experts and program == "parallel_5d":
            return M * layers * (calls // 2) * (2 * (t - 1) * full // t) + ends + moe_under_tp(m, layers, samples,
                                                                                              full, t, M)
        return M * layers * calls * (2 * (t - 1) * full // t) + ends
    # sequence parallel: each all-reduce becomes an all-gather of my 1/t of the tokens ((t-1) x my part) or a
    # reduce-scatter ((t-1)/t of the whole); the head's pooled share summed over tp (one all-reduce of [b, h]
    # a microbatch, if my chunks end the model); once a step, the partial gradients of what runs on my tokens
    # only (the embedding, every LayerNorm, the row-parallel biases) summed (mp.tp.sequence)
    sent = M * layers * 2 * calls * ((t - 1) * (full // t)) + ends   # an all-gather and a reduce-scatter an all-reduce
    if m.blocks() - 1 in blocks and m.kind == "vit":
        sent += M * (2 * (t - 1) * samples * m.hidden * FLOAT // t)
    # the gpt's token table is complete on each rank (every token's rows, mine by the vocabulary): not partial
    partial = sum(q.numel() for i in blocks for q in block_params(m, i, t)
                  if (i == 0 and q.name != "tok.weight") or (q.name.startswith("ln") and i < m.blocks() - 1)
                  or q.name in ROW_BIASES)
    partial += 2 * m.hidden if m.blocks() - 1 in blocks else 0   # the head's LayerNorm
    return sent + 2 * (t - 1) * (partial * FLOAT) // t


# the cnn's layers as tensor_parallel.py cuts them (mp/plan/model.py CNN): (split, input features, output
# features at the all-reduce: a row-parallel conv's before its pooling)
CNN_LAYERS = [("col", 3 * 32 * 32, 6 * 28 * 28), ("row", 6 * 14 * 14, 16 * 10 * 10), ("col", 400, 120),
              ("row", 120, 84), ("col", 84, 10)]


def small_tp_sent(m, blocks, samples, t, tp_rank, args):
    """The mlp's and the cnn's tensor parallelism, a microbatch: a row-parallel layer's output all-reduced
    (forward), a column-parallel layer's input gradient all-reduced (backward; the first layer's input is the
    data), the last layer's columns all-gathered when it is column-parallel. --hybrid: the convolutions run on
    1/t of the batch each, their features all-gathered before the classifier."""
    if m.kind == "mlp":
        layers = [("row" if i % 2 else "col", 3 * 32 * 32 if i == 0 else m.hidden,
                   NUM_CLASSES if i == m.layers - 1 else m.hidden) for i in range(m.layers)]
    else:
        layers = CNN_LAYERS
    sent = 0
    for i in blocks:
        split, fan_in, fan_out = layers[i]
        if i in hybrid_blocks(m, args):
            if i == 1:   # the conv features' all-gather: my samples' [b/t, 16, 5, 5]
                sent += (t - 1) * (samples // t) * 400 * FLOAT
            continue
        if split == "row":
            sent += 2 * (t - 1) * samples * fan_out * FLOAT // t
        elif i > 0:
            sent += 2 * (t - 1) * samples * fan_in * FLOAT // t
        if split == "col" and i == len(layers) - 1:
            sent += (t - 1) * samples * split_sizes(fan_out, t)[tp_rank] * FLOAT
    return sent


def hybrid_sync(m, t, args):
    """--hybrid: the convolutions' gradients all-reduced over tp (they are data-parallel there), once a step."""
    convs = sum(q.numel() for i in hybrid_blocks(m, args) for q in block_params(m, i))
    return 2 * (t - 1) * convs * FLOAT // t


def moe_under_tp(m, layers, samples, full, t, M):
    """parallel_5d.py's mixture of experts under tp (no sp), which routes each token once: the tp ranks split the
    tokens, route their halves ([b, K, E] counts all-gathered over tp), and all-gather the combined rows after the
    experts (forward) and the input gradients' halves (backward), in place of the MLP's two all-reduces (the
    attention keeps its two); once a step the router's gradient (each rank's tokens' part) summed over tp."""
    per_microbatch = (t - 1) * samples * m.top_k * m.experts * 8 + 2 * (t - 1) * (full // t)
    return layers * (M * per_microbatch + 2 * (t - 1) * m.experts * m.hidden * FLOAT // t)


def gpt_ends(m, blocks, samples, tokens, t, sp):
    """The gpt's vocabulary split (mp.tp.vocab), a microbatch: the embedding's partial rows summed (an all-reduce
    of [b, s, h]; under sp a reduce-scatter to my tokens and, backward, its all-gather), the head's input gradient
    summed (an all-reduce; under sp the input's all-gather and, backward, a reduce-scatter), and the
    cross-entropy's max and (sum of exponentials, target logit) over the vocabulary ([b, s] and [2, b, s])."""
    if m.kind != "gpt":
        return 0
    full = samples * tokens * m.hidden * FLOAT
    end = 2 * (t - 1) * (full // t) if sp else 2 * (t - 1) * full // t
    sent = end if 0 in blocks else 0
    if m.blocks() - 1 in blocks:
        sent += end + 2 * (t - 1) * (3 * samples * tokens * FLOAT) // t
    return sent


ROW_BIASES = ("attn.proj.bias", "mlp.2.bias")


# ----------------------------------------------------------------------------- the summary's fields


def per_replica_samples(program, args, grid):
    """Samples in one microbatch on one rank: the global batch over the replicas and the microbatches."""
    replicas = grid.dp if program in ("pipeline_dp_joint", "parallel_3d", "parallel_5d", "expert_parallel") else 1
    return args.batch_size // (replicas * microbatches(program, args))


def counts(program, args, world, backend="gloo"):
    """The summary record's per-rank fields, as a run of `program` with these parsed flags on `world` ranks
    would log them: {param_mb, grad_mb, optimizer_state_mb, dp_sent_mb_per_step, sent_mb_per_step}."""
    m, grid = from_args(args), grid_of(program, args, world)
    args.microbatches_per_replica = microbatches(program, args)
    samples = per_replica_samples(program, args, grid)
    tokens = m.tokens // grid.cp
    fields = {"param_mb": {}, "grad_mb": {}, "optimizer_state_mb": {}}
    args.program = program
    if grid.dense_sync and not grid.flat:
        fields["dp_sent_mb_per_step"] = {}
    sent = {}
    for rank in range(world):
        held, groups = holdings(m, grid, rank, args, backend)
        r = str(rank)
        fields["param_mb"][r] = round(held["param"] / MB, 4)
        fields["grad_mb"][r] = round(held["grad"] / MB, 4)
        fields["optimizer_state_mb"][r] = round(held["state"] / MB, 4)
        if "dp_sent_mb_per_step" in fields:
            fields["dp_sent_mb_per_step"][r] = round(held["dp_ring"] / MB, 4)
        pp, gathered = pp_sent(m, grid, rank, args, samples, tokens, program)
        groups["pp"] = pp
        groups["tp"] = tp_sent(m, grid, rank, args, samples, tokens, program) + gathered
        groups["cp"] = groups.get("cp", 0) + cp_sent(m, grid, rank, args, samples, tokens, program)
        groups["ep"] = groups.get("ep", 0) + ep_sent(m, grid, rank, args, samples, tokens, program)
        if program == "parallel_5d" and m.experts:
            routing_sums(m, grid, rank, args, samples, groups)
        groups["embed"] = embed_sent(m, grid, rank, args)
        if m.experts and grid.ep > 1:
            fields.setdefault("all_to_all_mb_per_step", {})[r] = round(
                all_to_all(m, grid, rank, samples, tokens, program, args) / MB, 6)
        for name, nbytes in groups.items():
            sent.setdefault(name, {})[r] = nbytes
    fields["sent_mb_per_step"] = {name: {r: round(b / MB, 6) for r, b in ranks.items()}
                                  for name, ranks in sorted(sent.items()) if any(ranks.values())}
    return fields


def program_of(args):
    return getattr(args, "program", "")


def head_fc(m):
    """The vit's classifier's elements (Linear(h, 10))."""
    return m.hidden * 10 + 10


def transformer_layers(m, grid, rank, args):
    _, p, _, _ = grid.coords(rank)
    blocks = [i for chunk in my_blocks(args, m, grid, p) for i in chunk]
    return blocks, sum(1 for i in blocks if 0 < i < m.blocks() - 1)


def cp_sent(m, grid, rank, args, samples, tokens, program):
    """Context parallelism, a microbatch: the ring passes each attention layer's stacked K and V ([2, b, heads,
    s/c, hd]) c-1 hops forward, and in the backward c-1 hops again plus the c hops that carry dK, dV home;
    Ulysses all-to-alls q, k, v to head shards and the output back, forward and backward ((c-1)/c of each).
    The vit's head's pooled share is all-reduced over cp (context_parallel.py's SummedHead), once a microbatch
    (the gpt's head works on my tokens: nothing to sum)."""
    c = grid.cp
    if c == 1 or m.kind not in ("vit", "gpt"):
        return 0
    blocks, layers = transformer_layers(m, grid, rank, args)
    share = samples * tokens * m.hidden * FLOAT // grid.tp    # my tokens of my tp rank's heads
    if getattr(args, "attention", "ring") == "ring":
        per_layer = ((c - 1) + (c - 1) + c) * 2 * share
    else:
        per_layer = 2 * 4 * ((c - 1) * share // c)
    head = 2 * (c - 1) * (samples * m.hidden * FLOAT) // c if m.blocks() - 1 in blocks and m.kind == "vit" else 0
    return microbatches(program, args) * (layers * per_layer + head)


def all_to_all(m, grid, rank, samples, tokens, program, args):
    """The dispatch and combine, forward and backward (4 all-to-alls a MoE layer a microbatch), each sending the
    rows for the other ep ranks: with an even (dropless) route, (N-1)/N of my tokens x top_k. The route is
    learned, so a run's count differs from this expectation (tests: within 10%)."""
    if not m.experts or grid.ep == 1:
        return 0
    layers = transformer_layers(m, grid, rank, args)[1]
    routed_once = grid.tp if program == "parallel_5d" else 1   # 5-D: each tp rank routes 1/T of the tokens
    rows = samples * tokens * m.top_k // routed_once
    return microbatches(program, args) * layers * 4 * (grid.ep - 1) * rows * m.hidden * FLOAT // grid.ep


def ep_sent(m, grid, rank, args, samples, tokens, program):
    """The all-to-alls, and each MoE layer's all-gather of the routing counts ([K, E] int64 a rank)."""
    if not m.experts or grid.ep == 1:
        return 0
    counts = (grid.ep - 1) * m.top_k * m.experts * 8
    layers = transformer_layers(m, grid, rank, args)[1]
    return all_to_all(m, grid, rank, samples, tokens, program, args) + microbatches(program, args) * layers * counts


def routing_sums(m, grid, rank, args, samples, groups):
    """parallel_5d.py's mixture of experts: each MoE layer's expert counts per sample and choice ([b, K, E] int64,
    mp.ep.order; gathered over tp first where tp splits the tokens, [T, b, K, E]) all-gathered over dp x cp (a
    microbatch's statistics are the whole microbatch's, equivalence rule 8), and once a step the load-balancing
    loss's scalar summed over dp x cp, over the pipeline and over tp (4-byte all-reduces); the counts' tp gather
    and the rest of a MoE layer's traffic under tp: moe_under_tp."""
    n, layers = grid.dp * grid.cp, transformer_layers(m, grid, rank, args)[1]
    block = grid.tp * samples * m.top_k * m.experts * 8
    groups["dp_cp"] = groups.get("dp_cp", 0) + microbatches("parallel_5d", args) * layers * (n - 1) * block + \
        2 * (n - 1) * FLOAT // n
    groups["pp"] = groups.get("pp", 0) + 2 * (grid.pp - 1) * FLOAT // grid.pp
    groups["tp"] = groups.get("tp", 0) + 2 * (grid.tp - 1) * FLOAT // grid.tp   # and over tp, which split the tokens
