"""Pipeline schedules as data: which forward (F), backward (B) and weight-gradient (W) pass each rank
runs, in what order, and where the messages go. Pure functions of (schedule, stages p, microbatches m,
virtual stages v), tested without processes; pipeline_microbatch.py's StageRunner plays the action lists they return.

    python -m mp.tools.schedule --schedule zb --stages 4 --microbatches 4         # prints the table below
    python -m mp.tools.schedule --schedule interleaved --stages 4 --microbatches 8 --virtual-stages 2 -o plan.png

Schedules, 4 stages x 4 microbatches, per clock tick (F3: forward of microbatch 3, B3: its
backward, . idle: the bubble; drawn by clock_table() with B as long as F):

    gpipe: all forwards, then all backwards
    stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
    stage 1: .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
    stage 2: .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3
    stage 3: .  .  .  F0 F1 F2 F3 B0 B1 B2 B3

    1f1b: stage r runs p-r-1 forwards (warm-up), then alternates one forward, one backward
    stage 0: F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3
    stage 1: .  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    stage 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3
    stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3

    interleaved, V=2 chunks per rank (a: blocks of virtual stage r, b: of r+p; a tick is half a stage)
    stage 0: F0a F1a F2a F3a F0b F1b F2b F3b .   .   .   B0b .   B1b .   B2b .   B3b B0a B1a B2a B3a
    stage 1: .   F0a F1a F2a F3a F0b F1b F2b F3b .   B0b .   B1b .   B2b .   B3b B0a B1a B2a B3a
    stage 2: .   .   F0a F1a F2a F3a F0b F1b F2b B0b F3b B1b .   B2b .   B3b B0a B1a B2a B3a
    stage 3: .   .   .   F0a F1a F2a F3a F0b B0b F1b B1b F2b B2b F3b B3b B0a B1a B2a B3a

    zb (ZB-H1): 1F1B with each backward split into B, the input gradient the stage before waits
    for, and W, the weight gradient nobody waits for (a tick each: 1F1B's B above is a B and a W);
    stage r runs its first r W's late, in the cool-down, where 1F1B's ranks sit idle
    stage 0: F0 F1 F2 F3 .  .  .  B0 W0 B1 W1 B2 W2 B3 W3
    stage 1: .  F0 F1 F2 .  .  B0 F3 B1 W0 B2 W1 B3 W2 W3
    stage 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 B3 W1 W2 W3
    stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3

    zbv (ZB-V), drawn on 2 stages x 3 microbatches: zb's split on 2 chunks per rank placed in a V,
    a: virtual stage r, b: 2p-1-r (a tick is half a stage's F, B or W); rank 0 holds the model's
    two ends (the inputs and the loss), rank p-1 its middle, handed from chunk a to b in place
    stage 0: F0a F1a F2a F0b B0b W0b F1b B1b W1b B0a W0a F2b B2b W2b B1a W1a B2a W2a
    stage 1: .   F0a F0b F1a F1b B0b W0b F2a B0a W0a F2b B1b W1b B1a B2b B2a W1a W2b W2a

GPipe and 1F1B take the same 2(m+p-1) ticks, a bubble of (p-1)/(m+p-1); but 1F1B holds at most
p - r microbatches' activations on stage r instead of all m, so its memory does not grow with m.
Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv 2104.04473; its Figure 4, bottom, draws this schedule, and its
Figure 5 is tensor parallelism's f and g, in tensor_parallel.py) gives each rank V chunks of the
model (virtual stages r, r+p, r+2p, ...): 2(Vm+p-1) ticks of 1/V stage each, a bubble of
(p-1)/(Vm+p-1), for V times the messages. ZB-H1 (Qi et al. 2024) takes 3m+p-1 ticks of F, B or W,
a bubble of (p-1)/(3m+p-1): a third of 1F1B's for m >> p, with at most p microbatches in flight
(F done, W not yet) on any stage. ZB-V (the same paper, section 6) takes 6m+p-1 ticks of half a
stage once m >= 2p-1: a bubble of (p-1)/(6m+p-1), half of ZB-H1's and a sixth of 1F1B's for m >> p,
holding about 1F1B's first stage's activations (2p chunk-microbatches of half a stage each).
"""

from bisect import bisect_left
from dataclasses import replace

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "2bw")


# A compute action is ("F", "B" or "W", microbatch, chunk). A communication action is ("comm", parts),
# parts being ("send" or "recv", peer rank, message) posted together and then all waited for.
# A message is (what, microbatch, virtual stage of its receiver), what = "act" or "grad".


def flow_name(parts):
    """Megatron's name for one exchange, after the data flow: recv_forward (an activation comes in),
    send_backward (a gradient goes out), send_forward_recv_backward, ... send_forward_backward_recv_forward_backward."""
    name = []
    for kind in ("send", "recv"):
        ways = [way for what, way in (("act", "forward"), ("grad", "backward"))
                if any(k == kind and m[0] == what for k, _, m in parts)]
        name += [f"{kind}_{'_'.join(ways)}"] if ways else []
    return "_".join(name)


def forward_order(schedule, p, m, rank, v):
    """(microbatch, chunk) in the order this rank runs forwards; interleaved goes p microbatches
    through chunk 0, the same p through chunk 1, ..., then the next p microbatches."""
    if schedule != "interleaved":
        return [(i, 0) for i in range(m)]
    return [((k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]


def compute_units(schedule, p, m, rank, v=1):
    """The F/B order of one rank, the whole schedule as data, in units that run between two
    communication actions: a warm-up forward, a steady-state (forward, backward) pair, a cool-down
    backward.
      gpipe:       F0 .. F(m-1), then B0 .. B(m-1)
      1f1b:        warm-up of p-rank-1 forwards, then F and B alternate, then the remaining B
      interleaved: the same three phases over m*v (microbatch, chunk) pairs, backwards through
                   the chunks in reverse, warm-up 2(p-rank-1) + (v-1)p (Narayanan et al. 2021,
                   arXiv 2104.04473, Figure 4 bottom; Megatron-LM's
                   forward_backward_pipelining_with_interleaving)"""
    fwd = forward_order(schedule, p, m, rank, v)
    bwd = [(mb, v - 1 - c) for mb, c in fwd]
    if schedule == "zb":
        return zero_bubble_units(p, m, rank)
    if schedule == "zbv":
        return [[action] for action in zbv_order(p, m, rank)]
    if schedule == "2bw":                  # two steps, the second's microbatches numbered m .. 2m-1
        return pipedream_units(p, m, rank, last=False) + \
            [[(k, mb + m, c) for k, mb, c in unit] for unit in pipedream_units(p, m, rank, first=False)]
    if schedule == "gpipe":
        return [[("F", *a)] for a in fwd] + [[("B", *a)] for a in bwd]
    warm = p - rank - 1 if schedule == "1f1b" else 2 * (p - rank - 1) + (v - 1) * p
    warm = min(warm, len(fwd))
    steady = [[("F", *fwd[warm + i]), ("B", *bwd[i])] for i in range(len(fwd) - warm)]
    return [[("F", *a)] for a in fwd[:warm]] + steady + [[("B", *a)] for a in bwd[len(fwd) - warm:]]


def zero_bubble_units(p, m, rank):
    """ZB-H1 (Qi et al. 2024): 1F1B's order with each backward split in two, B (the input
    gradient, which the stage before waits for) and W (the weight gradient, which nobody waits
    for). Stage r runs W i microbatches late for i = r: its first r W's slide into the
    cool-down, where 1F1B idles, so the bubble is (p-1)/(3m+p-1) instead of 3(p-1)/(3m+3(p-1)).
    A microbatch is in flight from its F until its W: at most p on every stage, the bound of
    1F1B's first stage."""
    warm, late = min(p - rank - 1, m), []
    units = [[("F", i, 0)] for i in range(warm)]
    for i in range(m):
        unit = ([("F", warm + i, 0)] if warm + i < m else []) + [("B", i, 0)]
        late.append(i)
        if len(late) > rank:                             # W of the microbatch `rank` backwards ago
            unit.append(("W", late.pop(0), 0))
        units.append(unit)
    return units + [[("W", i, 0)] for i in late]


def placement_of(schedule):
    """Where a rank's chunks sit: "v" for zbv (down the ranks and back up), else "loop" (interleaved's
    round: chunk c of rank r is virtual stage c*p + r). torch's generate_stage_to_rank_mapping styles."""
    return "v" if schedule == "zbv" else "loop"


def virtual_stage(chunk, rank, p, placement="loop"):
    """The virtual stage that chunk `chunk` of rank `rank` holds. loop: chunk*p + rank. v (2 chunks):
    chunk 0 is virtual stage rank, chunk 1 is 2p-1-rank, so rank p-1 holds the V's tip (p-1 and p)
    and rank 0 holds both ends, the model's input and its loss."""
    return 2 * p - 1 - rank if placement == "v" and chunk == 1 else chunk * p + rank


def stage_owner(vstage, p, placement="loop"):
    """(rank, chunk) that holds virtual stage vstage: virtual_stage's inverse (loop: round a ring,
    so one past either end wraps; the schedules never send there)."""
    if placement == "v" and p <= vstage < 2 * p:
        return 2 * p - 1 - vstage, 1
    return vstage % p, vstage // p


def peer_of(pos, chunk, step):
    """Global rank and chunk of the virtual stage `step` (+-1) away from my chunk (PipelineRank.peer)."""
    rank, chunk = stage_owner(virtual_stage(chunk, pos.pp_rank, pos.pp_size, pos.placement) + step,
                              pos.pp_size, pos.placement)
    return pos.ranks[rank], chunk


def is_mine(pos, vstage):
    """Does this rank hold virtual stage vstage? zbv's tip: a message between two chunks of one rank
    goes straight from its outbox to its inbox, never over the wire."""
    return stage_owner(vstage, pos.pp_size, pos.placement)[0] == pos.pp_rank


def zbv_order(p, m, rank):
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6; torch's ScheduleZBVZeroBubble):
    two chunks per rank in a V (chunk 0: virtual stage r, chunk 1: 2p-1-r), each backward split into
    B and W as zb's. Warm-up: 2(p-r)-1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0),
    then p-r times F, B, W of chunk 1 (the V's way back starts on the rank that ran its way down);
    steady state: F B W of chunk 0, F B W of chunk 1; cool-down: r pairs of B (chunk 0, chunk 1),
    p-r of (B, W) of chunk 0, then the W's left. Planned for max(m, 2p-1) microbatches, the fewest
    that fill the V, and played for the first m (torch's rule): an action (kind, microbatch, chunk)."""
    n, order, done = max(m, 2 * p - 1), [], {}

    def run(*pairs):                                     # (kind, chunk): the next microbatch of each
        for kind, chunk in pairs:
            mb = done[(kind, chunk)] = count(kind, chunk)
            order.append((kind, mb, chunk))

    def count(kind, chunk):                              # how many of that kind and chunk so far
        return done.get((kind, chunk), -1) + 1

    run(*[("F", 0)] * (2 * (p - rank) - 1))
    run(*[("F", 1), ("F", 0)] * rank)
    run(*[("F", 1), ("B", 1), ("W", 1)] * (p - rank))
    while count("F", 1) < count("F", 0) or count("F", 0) < n:
        run(*([("F", 0)] if count("F", 0) < n else []), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    run(*[("B", 0), ("B", 1)] * rank)
    run(*[("B", 0), ("W", 0)] * (p - rank))
    run(*[("W", 1)] * (count("B", 1) - count("W", 1)), *[("W", 0)] * (count("B", 0) - count("W", 0)))
    return [action for action in order if action[1] < m]


def pipedream_units(p, m, rank, first=True, last=True):
    """PipeDream-2BW (Narayanan et al. 2021): 1F1B never flushed. One optimizer step of stage r is
    m (forward, backward) pairs: F(j + w), B(j) for j < m, with w = p-r-1 as in 1F1B's warm-up, so
    its last w forwards, numbered m .. m+w-1, are the next batch's first microbatches. Only the
    first step warms up (F0 .. F(w-1)) and only the last drains (its last w backwards alone).
    Needs m >= p: then every microbatch in flight on a stage belongs to this batch or the next,
    so two weight versions suffice (pipedream.py)."""
    assert m >= p, f"2bw needs at least as many microbatches as stages, got m={m}, p={p}"
    w = p - rank - 1
    pairs = m - w if last else m
    units = [[("F", i, 0)] for i in range(w)] if first else []
    units += [[("F", j + w, 0), ("B", j, 0)] for j in range(pairs)]
    return units + ([[("B", j, 0)] for j in range(pairs, m)] if last else [])


def pipedream_actions(pos, m, first=True, last=True):
    """One step of 2bw with its messages. The step ends with the exchange that also receives the
    next step's first input (posted here, so every message sent in a step is received in it: no
    send is left waiting across the optimizer step, the gradient-norm collective or an evaluation),
    and a later step does not post that receive again. The microbatches m .. 2m-1 of this step are
    0 .. m-1 of the next one (mp.pp.pipedream.TwoVersions renumbers what it carries over)."""
    units = [[a] for unit in pipedream_units(pos.pp_size, m, pos.pp_rank, first, last) for a in unit]
    ahead = None if last else ("F", m + pos.pp_size - pos.pp_rank - 1, 0)   # the next step's first action
    actions = with_communication(units + ([[ahead]] if ahead else []), pos)
    if ahead:
        actions = actions[:actions.index(ahead)]
    if not first and actions[0][0] == "comm":            # received at the end of the step before
        actions = actions[1:]
    return actions


def compute_order(schedule, p, m, rank, v=1):
    return [action for unit in compute_units(schedule, p, m, rank, v) for action in unit]


def clock_table(schedule, p, m, v=1):
    """The schedule drawn per clock tick (the tables in the module docstring): every F, B and W
    lasts one tick and starts once its rank is free and its input is ready (W: its own B). Interleaved chunks are
    letters (F0a: microbatch 0 through chunk a, a tick of 1/v of a stage's work); '.' is idle."""
    rows = clock_cells(schedule, p, m, v)
    width = max(len(cell) for row in rows for cell in row)
    return [f"stage {r}: " + " ".join(cell.ljust(width) for cell in row).rstrip() for r, row in enumerate(rows)]


def clock_cells(schedule, p, m, v=1):
    """clock_table's cells: a list per stage, one cell per tick ("F3", "B1b", "W0" or "." idle)."""
    v = 2 if schedule == "zbv" else v                    # zbv: always two chunks, in a V
    orders, last = [compute_order(schedule, p, m, r, v) for r in range(p)], p * v - 1
    done, rows = {}, [[] for _ in range(p)]              # done: (kind, mb, virtual stage) -> end tick
    while len(done) < sum(map(len, orders)):
        before = len(done)
        for r, row in enumerate(rows):
            placed = len(row) - row.count(".")
            if placed == len(orders[r]):
                continue
            kind, mb, chunk = orders[r][placed]
            vs = virtual_stage(chunk, r, p, placement_of(schedule))
            if kind == "F":
                need = ("F", mb, vs - 1) if vs > 0 else None
            elif kind == "W":
                need = ("B", mb, vs)
            else:
                need = ("B", mb, vs + 1) if vs < last else ("F", mb, vs)
            if need is None or need in done:
                start = max(len(row), done.get(need, 0))
                row += ["."] * (start - len(row)) + [f"{kind}{mb}" + ("abcdefgh"[chunk] if v > 1 else "")]
                done[(kind, mb, vs)] = start + 1
        assert len(done) > before, "the compute orders wait on each other"
    return rows


def messages(action, pos):
    """What `action` must receive before it runs, and what it sends once done (None: nothing)."""
    kind, mb, chunk = action
    if kind == "W":                                      # the weight gradient stays on its rank
        return None, None
    vstage, last = virtual_stage(chunk, pos.pp_rank, pos.pp_size, pos.placement), pos.pp_size * pos.virtual - 1
    prev_rank, _ = pos.peer(chunk, -1)
    next_rank, _ = pos.peer(chunk, +1)
    # no message before the first virtual stage, after the last, nor across zbv's tip (both sides mine)
    first, final = vstage == 0 or is_mine(pos, vstage - 1), vstage == last or is_mine(pos, vstage + 1)
    if kind == "F":
        recv = ("recv", prev_rank, ("act", mb, vstage)) if not first else None
        send = ("send", next_rank, ("act", mb, vstage + 1)) if not final else None
    else:
        recv = ("recv", next_rank, ("grad", mb, vstage)) if not final else None
        send = ("send", prev_rank, ("grad", mb, vstage - 1)) if not first else None
    return recv, send


def with_communication(units, pos, fused=True):
    """Insert the messages: before each unit, the sends of the previous unit go out together with
    the receives this unit needs (send_forward_recv_backward and friends), all posted at once, so
    two neighbours that cross never both block. fused=False is the textbook order that deadlocks on
    gloo: one action at a time, each message posted and waited for on its own, sends first."""
    if not fused:
        units = [[action] for unit in units for action in unit]
    actions, pending = [], []
    for unit in units:
        posted = list(pending)
        for action in unit:
            recv, send = messages(action, pos)
            posted += [recv] if recv else []
        if fused and posted:
            actions.append(("comm", posted))
        elif posted:
            actions += [("comm", [part]) for part in posted]
        actions += unit
        pending = [send for _, send in map(lambda a: messages(a, pos), unit) if send]
    return actions + ([("comm", pending)] if pending else [])


def rendezvous(schedule, positions, m, me):
    """zbv's messages, placed on the clock table (clock_cells: every F, B and W one tick, each as
    early as its rank and its input allow): a message meets its receive at the tick the action that
    reads it starts. The receiver posts the receive in the exchange just before that action; the
    sender posts the send in the exchange before its first action starting at that tick or later
    (after its last one, if none), sends in the order of their ticks. Both are posted then, which
    gloo's blocking sends need: with_communication's rule (every send in the exchange right after
    its compute) deadlocks here, as chunk 0's forwards go down while chunk 1's come up and a send
    waits for a receive posted ticks later (dry_run names the cycle). Every rank places every
    message the same way and keeps its own actions: rank `me`'s."""
    p, ranks = len(positions), positions[0].ranks
    orders = [compute_order(schedule, p, m, r) for r in range(p)]
    starts = [[tick for tick, cell in enumerate(row) if cell != "."] for row in clock_cells(schedule, p, m)]
    sends = [[[] for _ in range(len(order) + 1)] for order in orders]   # rank -> action index -> (tick, send)
    for r, order in enumerate(orders):
        for action, tick in zip(order, starts[r]):
            recv, _ = messages(action, positions[r])
            if recv:
                sender = ranks.index(recv[1])
                at = bisect_left(starts[sender], tick)          # its first action starting then or later
                sends[sender][at].append((tick, ("send", ranks[r], recv[2])))
    actions = []
    for i, action in enumerate(orders[me] + [None]):
        recv = messages(action, positions[me])[0] if action else None
        parts = [part for _, part in sorted(sends[me][i])] + ([recv] if recv else [])
        actions += ([("comm", parts)] if parts else []) + ([action] if action else [])
    return actions


def schedule_actions(schedule, pos, m, fused=True, first=True, last=True, sends_at_once=False):
    """One step's actions of this rank, messages included. first/last: 2bw's first and last steps,
    which warm up and drain; its other steps do neither. sends_at_once (zbv on gloo,
    mp.pp.p2p.sends_at_once): zbv's sends too go out in the exchange right after their compute, as
    with_communication places every other schedule's, for an executor that waits for its sends only
    at the step's end (no send blocks, so none can close a cycle: dry_run(..., blocking_sends=False)
    plays it); without, rendezvous's placement, which holds with sends that block (nccl's stream)."""
    assert pos.placement == placement_of(schedule), f"{schedule} runs on chunks placed {placement_of(schedule)!r}"
    if schedule == "2bw":
        return pipedream_actions(pos, m, first, last)
    if schedule == "zbv" and not sends_at_once:
        positions = [replace(pos, pp_rank=r) for r in range(pos.pp_size)]
        return rendezvous(schedule, positions, m, pos.pp_rank)
    units = compute_units(schedule, pos.pp_size, m, pos.pp_rank, pos.virtual)
    if schedule != "interleaved":  # exchange between every two actions: F runs as soon as its input is in
        units = [[action] for unit in units for action in unit]
    return with_communication(units, pos, fused)


def eval_actions(pos, n):
    """Forwards only, batch by batch through my chunks. Not chunk by chunk: with interleaving, rank
    p-1 would block sending batch 0 into rank 0's chunk 1 while rank 0 blocks sending batch 2 into
    rank 1's chunk 0 (dry_run finds the cycle)."""
    return with_communication([[("F", mb, c)] for mb in range(n) for c in range(pos.virtual)], pos)


def dry_run(all_actions, blocking_sends=True):
    """Play every rank's actions with blocking sends (a send completes only once its receive is
    posted, as on gloo), or with sends that never block (blocking_sends=False: an executor that waits
    for them only at the step's end; a receive completes once its send is posted). Returns None if
    all finish, else the first cycle of waiting ranks."""
    at, done = [0] * len(all_actions), [set() for _ in all_actions]
    posted = set()                                       # (sender, message) of every send posted so far
    while True:
        moved = False
        for r, actions in enumerate(all_actions):
            while at[r] < len(actions) and actions[at[r]][0] != "comm":
                at[r] += 1                               # compute never blocks
            if at[r] == len(actions):
                continue
            for part in actions[at[r]][1]:
                kind, peer, msg = part
                if not blocking_sends:                   # a send is done once posted, a receive once its send is
                    if part not in done[r] and (kind == "send" or (peer, msg) in posted):
                        done[r].add(part)
                        if kind == "send":
                            posted.add((r, msg))
                        moved = True
                    continue
                peer_parts = all_actions[peer][at[peer]][1] if at[peer] < len(all_actions[peer]) and \
                    all_actions[peer][at[peer]][0] == "comm" else []
                twin = ("recv" if kind == "send" else "send", r, msg)
                if part not in done[r] and twin in peer_parts:
                    done[r].add(part), done[peer].add(twin)
                    moved = True
            if all(part in done[r] for part in actions[at[r]][1]):
                at[r], moved = at[r] + 1, True
        if all(a == len(actions) for a, actions in zip(at, all_actions)):
            return None
        if not moved:
            return waiting_cycle(all_actions, at, done)


def waiting_cycle(all_actions, at, done):
    """Follow 'rank r waits for its peer' from a blocked rank until a rank repeats."""
    waits = {r: next(p for p in all_actions[r][at[r]][1] if p not in done[r])
             for r in range(len(all_actions)) if at[r] < len(all_actions[r])}
    r, path = next(iter(waits)), []
    while r not in path and r in waits:               # not in waits: r has finished, the message is missing
        path.append(r)
        r = waits[r][1]
    cycle = path[path.index(r):] if r in path else path[-1:]
    return [f"rank {q} blocked in {waits[q][0]} {waits[q][2][0]} of microbatch {waits[q][2][1]} "
            f"with rank {waits[q][1]}" + ("" if waits[q][1] in waits else ", which has finished") for q in cycle]


def bubble_theory(p, m, v=1, schedule=None, steps=None):
    """Idle fraction of the clock table: (p-1)/(vm+p-1); for zb (F, B and W one tick each, m >= p)
    (p-1)/(3m+p-1), about a third of 1F1B's; for zbv (m >= 2p-1) (p-1)/(6m+p-1), half of zb's. 2bw
    fills once and drains once over all its steps: (p-1)/(steps*m+p-1), and a step in the steady
    state (steps=None) has no bubble at all."""
    if schedule == "2bw":
        return 0.0 if steps is None else (p - 1) / (steps * m + p - 1)
    if schedule == "zb":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "zbv":                 # 6m half-stage ticks of work per rank; the V fills p-1 ticks late
        if m >= 2 * p - 1:
            return (p - 1) / (6 * m + p - 1)
        return 1 - 6 * m / max(len(row) for row in clock_cells("zbv", p, m))   # a V not full: the table's
    return (p - 1) / (v * m + p - 1)
