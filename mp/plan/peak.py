"""Each rank's peak resident memory above its process floor, predicted from a program's own flags (the vit).

The floor is what benchmarks/memory_per_rank.py subtracts: the peak of the same program, layout and rank with a
tiny model of the same depth (--hidden 8): the interpreter, torch, gloo and the data. So the planner predicts
both peaks, the run's and the floor's, with the same model of the step, and reports their difference: whatever
does not depend on the width (the data, the attention's [b, heads, s, s] scores) cancels as it does in the
measurement.

A peak is a moment. The step is replayed, on each rank, action by action as mp.pp.schedules.compute_order
orders it, and block by block inside a backward, with what is alive at each moment:

    held always   weights (--zero 3: my slices, and the stage's blocks while gathered) and optimizer state
    forward F     + the tensors autograd saves for the chunk's blocks, per microbatch, until its backward
    backward B    walks the chunk's blocks last to first; at block j: + the gradients made so far this step
                  (autograd's .grad, or the buckets, mp.buckets), + the working set of j's backward (the
                  incoming gradient and the MLP's input gradients, or the attention's scores' gradients),
                  + a bucket's collective buffer in flight; then block j's saved tensors go
    update        weights, gradients and state (AdamW: one temporary of the state's size, torch's foreach sqrt)

What a block saves is counted from mp/models.py, in units of one [b, s, h] tensor (bsh) of the microbatch:
a transformer block keeps ln1's output, q, k and v (matmul's contiguous copies), the attention's output
before proj, the residual x1, ln2's output, fc1's and GELU's outputs (2 bsh each: the MLP is 2h wide) and
its output: 12 bsh, plus the softmax's [b, heads, s, s]. The ring (context_parallel.py) saves q, k, v, its
output and a log-sum-exp a query instead of the scores, on s/c tokens: 13 bsh. A mixture of experts saves,
for each of a token's K rows (an even route), the experts' input, fc1's and GELU's outputs and the combined
rows: 1 + 6K bsh in place of the MLP's 5.
"""
from mp.plan.model import block_params, from_args
from mp.plan.buckets import BUCKET_MB, FLOAT, MB, bucket_numels, padded
from mp.plan.project import grid_of, microbatches, my_blocks, per_replica_samples
from mp.pp.schedules import compute_order

EXCHANGES_AHEAD = 16  # mp.pp.p2p.EXCHANGES_AHEAD: gloo's receives posted that many exchanges ahead
IN_FLIGHT = 2        # mp.buckets.IN_FLIGHT: reduce-scatters on their way at once under --zero 2 and 3
FLOOR_HIDDEN = 8     # the floor's model (benchmarks/memory_per_rank.py)
# the programs whose peaks tests/test_plan.py measures; tensor parallelism's saved slices are not modelled yet
PEAK_PROGRAMS = ("pipeline_microbatch", "pipeline_dp_joint", "context_parallel", "expert_parallel")


def saved(m, i, samples, tokens, heads, ring):
    """Bytes block i keeps for its backward per microbatch, its output included (the next block's input)."""
    bsh = samples * tokens * m.hidden * FLOAT
    if i == 0:
        return bsh                                           # the embedding's output (its input is the data)
    if i == m.blocks() - 1:
        return samples * m.hidden * FLOAT                    # the pooled [b, h] the classifier saves
    attention = 5 * bsh + (samples * heads * tokens * FLOAT if ring else samples * heads * tokens ** 2 * FLOAT)
    mlp = (1 + 6 * m.top_k) * bsh if m.experts else 5 * bsh
    return attention + (1 + 1) * bsh + mlp + (bsh if ring else 0)


def working(m, i, samples, tokens, heads, ring):
    """The most a block's backward adds at once to what is saved: at the MLP, the incoming gradient and fc2's
    and GELU's input gradients (1 + 2 + 2 bsh, per expert row under MoE); at the attention, once the MLP's saved
    tensors are gone, two gradients of the residual and two of the scores (the ring: of one block of them)."""
    bsh = samples * tokens * m.hidden * FLOAT
    if i in (0, m.blocks() - 1):
        return bsh
    rows = m.top_k if m.experts else 1
    mlp = (1 + 4 * rows) * bsh
    scores = samples * heads * tokens * tokens * FLOAT
    return max(mlp, 2 * bsh + 2 * scores - (1 + 4 * rows) * bsh)


def block_bytes(m, grid, rank, args, i):
    """Bytes of my parameters of block i: (dense, my experts')."""
    _, _, _, t = grid.coords(rank)
    e0 = grid.ep_rank(rank) * m.experts // grid.ep
    mine = range(e0, e0 + m.experts // grid.ep) if m.experts else ()
    ps = block_params(m, i, grid.tp)
    dense = sum(q.numel(grid.tp, t) for q in ps if q.expert is None) * FLOAT
    return dense, sum(q.numel() for q in ps if q.expert in mine) * FLOAT


def bucket_plan(m, grid, rank, args, blocks, zero, n):
    """The data-parallel buckets of my dense gradients: (bucket bytes, the block whose backward makes each)
    in the order the backward makes them (mp.buckets: the parameters in backward order, cut as it cuts)."""
    sizes, owner = [], []
    for i in blocks:
        for q in block_params(m, i, grid.tp):
            if q.expert is None:
                sizes.append(q.numel(grid.tp, grid.coords(rank)[3]))
                owner.append(i)
    per_block = [[s for s, o in zip(sizes, owner) if o == i] for i in blocks]
    numels = bucket_numels(sizes, zero, getattr(args, "bucket_mb", None), per_block if zero == 3 else None)
    owners, k = [], len(sizes)
    for numel in numels:                  # each bucket takes the next parameters in backward order
        owners.append(owner[k - 1])
        left = numel
        while left > 0:
            k -= 1
            left -= sizes[k]
    return [(padded(b, n) if zero else b) * FLOAT for b in numels], owners


class Replay:
    """The live bytes of one rank through one step, and the largest moment seen (with its parts)."""

    def __init__(self, fixed):
        self.fixed, self.acts, self.grads, self.peak, self.parts = fixed, 0, 0, 0, {}

    def moment(self, working=0, buffers=0):
        total = sum(self.fixed.values()) + self.acts + self.grads + working + buffers
        if total > self.peak:
            self.peak = total
            self.parts = dict(self.fixed, gradients=self.grads, activations=self.acts, buffers=working + buffers)


def rank_peak(m, program, args, grid, rank):
    """(peak bytes, parts at that moment) of one rank, in one training step after the first."""
    _, p, c, _ = grid.coords(rank)
    chunks = my_blocks(args, m, grid, p)
    M = microbatches(program, args)
    samples = per_replica_samples(program, args, grid)
    tokens, heads, ring = m.tokens // grid.cp, m.heads // grid.tp, grid.cp > 1
    zero = getattr(args, "zero", 0) if grid.dense_sync and not grid.flat else 0
    n = grid.sync_size()
    blocks = [i for chunk in chunks for i in chunk]
    dense = {i: block_bytes(m, grid, rank, args, i) for i in blocks}
    weights = sum(d + e for d, e in dense.values())
    state_per = 2 if getattr(args, "optimizer", "sgd") == "adamw" else (1 if args.momentum else 0)
    held_w = weights if zero < 3 else weights // n
    state = state_per * (weights if zero == 0 else weights // n)
    replay = Replay({"weights": held_w, "optimizer": state})
    buckets = bucket_plan(m, grid, rank, args, blocks, zero, n) if grid.dense_sync and not grid.flat else ([], [])
    made = set()                                    # blocks whose gradients exist this step
    gathered = zero == 3 and M > 1 and getattr(args, "zero3_gather", None) != "microbatch"
    order = compute_order(getattr(args, "schedule", "gpipe"), grid.pp, M, p, getattr(args, "virtual_stages", 1))
    last_b = {chunk: max(k for k, a in enumerate(order) if a[0] == "B" and a[2] == chunk)
              for chunk in range(len(chunks))}
    # gloo's receives posted ahead (mp.pp.p2p.EXCHANGES_AHEAD): the buffers of the next exchanges' messages (an
    # activation before a forward of a chunk after the first, a gradient before a backward of a chunk before
    # the last) are held from their post, before their action runs
    cut = samples * tokens * m.hidden * FLOAT
    last_block = m.blocks() - 1
    posted = [cut if (kind == "F" and chunks[chunk][0] > 0) or (kind == "B" and chunks[chunk][-1] < last_block)
              else 0 for kind, _, chunk in order]
    for k, (kind, mb, chunk) in enumerate(order):
        ahead = sum(posted[k + 1:k + 1 + EXCHANGES_AHEAD]) if grid.pp > 1 else 0
        replay.fixed["posted receives"] = ahead
        if kind == "F":
            if gathered and not made:               # --zero 3, gathered once a step: the stage's whole blocks
                replay.fixed["weights"] = weights
            first = chunks[chunk][0]     # a chunk after the first keeps the activation it received
            received = samples * tokens * m.hidden * FLOAT if first > 0 else 0
            replay.acts += received + sum(saved(m, i, samples, tokens, heads, ring) for i in chunks[chunk])
            replay.moment()
            continue
        if kind != "B":
            continue
        for i in reversed(chunks[chunk]):
            if i not in made:
                made.add(i)
                replay.grads += grad_bytes(i, dense, zero, n, buckets)
            flight = collective_buffer(zero, buckets, made, k == last_b[chunk], grid)
            replay.moment(working(m, i, samples, tokens, heads, ring), flight)
            replay.acts -= saved(m, i, samples, tokens, heads, ring)
        if chunks[chunk][0] > 0:
            replay.acts -= samples * tokens * m.hidden * FLOAT
    if grid.flat:     # one all-reduce of every dense gradient at once: a flat copy of them beside autograd's
        replay.moment(buffers=sum(d for d, _ in dense.values()))
    replay.fixed["weights"], replay.fixed["posted receives"] = held_w, 0
    replay.moment(buffers=state // state_per if state_per == 2 else 0)   # the update (AdamW's temporary)
    return replay.peak, replay.parts


def grad_bytes(i, dense, zero, n, buckets):
    """The gradient memory that block i's first backward of the step makes: its parameters' .grad, or the
    buckets that start there (--zero 0, 1: whole, kept to the step's end; --zero 2, 3: my slice, the
    accumulator, the bucket itself let go after its reduce-scatter)."""
    d, e = dense[i]
    if not buckets[0]:
        return d + e
    made = sum(b for b, owner in zip(*buckets) if owner == i)
    return e + (made if zero < 2 else made // n)


def collective_buffer(zero, buckets, made, last, grid):
    """What the data-parallel collectives hold besides the gradients' own memory: --zero 0 and 1, in the last
    microbatch's backward, the bucket being all-reduced (gloo's ring works through a buffer of its size);
    --zero 2 and 3, in every backward, the whole buckets made and not yet reduce-scattered (mp.buckets'
    room: IN_FLIGHT + 1 of the set size at most)."""
    sizes = [b for b, owner in zip(*buckets) if owner in made]
    if not sizes or (zero < 2 and not last):
        return 0
    if zero < 2:
        return max(sizes)
    room = (IN_FLIGHT + 1) * max(BUCKET_MB * MB, sorted(b for b, _ in zip(*buckets))[len(buckets[0]) // 2])
    return min(sum(sizes), room)


def floor_args(args):
    """The floor's flags: the same, at --hidden 8."""
    tiny = type(args)(**vars(args))
    tiny.hidden = FLOOR_HIDDEN
    return tiny


def peak_above_floor(program, args, world):
    """{rank: {"peak_above_floor_mb": MB, "parts_mb": {weights, optimizer, gradients, activations, buffers}}},
    each the run's predicted peak minus its floor's (the same program and layout at --hidden 8)."""
    out = {}
    big_m, tiny_m = from_args(args), from_args(floor_args(args))
    grid = grid_of(program, args, world)
    for rank in range(world):
        big, parts = rank_peak(big_m, program, args, grid, rank)
        tiny, floor_parts = rank_peak(tiny_m, program, floor_args(args), grid, rank)
        out[str(rank)] = {"peak_above_floor_mb": round((big - tiny) / MB, 2),
                          "parts_mb": {k: round((v - floor_parts.get(k, 0)) / MB, 2) for k, v in parts.items()}}
    return out
