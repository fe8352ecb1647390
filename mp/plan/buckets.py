"""The data-parallel buckets as mp.buckets lays them, on element counts, and what their collectives send: the
planner's mirror of the package (tests/test_plan.py checks the grouping against mp.buckets' own on the same
sizes). No torch: plans are made without it.

    kept_groups      --zero 0/1: consecutive groups within a byte size, small parameters carried, a small tail joined
    capped_groups    --zero 2/3: groups of at most the cap (a larger tensor alone)
    bucket_groups    the order the backward makes them (the late ones last: the gpt's tied weight)
    bucket_traffic   each bucket's collectives a step, as a ring moves them and as mp/traffic.py meters them
"""
MB = 2**20
FLOAT = 4                 # float32: every parameter, gradient and activation here
BUCKET_MB, KEPT_MAX_MB = 4, 25   # mp.buckets: --zero 2, 3 buckets; --zero 0, 1 within [4, 25] MB


def kept_groups(sizes, nbytes):
    """mp.buckets.kept_groups on element counts: consecutive groups of at most nbytes, a small parameter just
    before one that opens a group (under 1/64 of it) carried into it, a last group under nbytes/4 joined on."""
    groups, held = [], 0
    for n in sizes:
        b = n * FLOAT
        if not groups or held + b > nbytes:
            carried = []
            while groups and groups[-1] and groups[-1][-1] * FLOAT * 64 < b:
                carried.insert(0, groups[-1].pop())
            if groups and not groups[-1]:
                groups.pop()
            groups.append(carried)
            held = sum(carried) * FLOAT
        groups[-1].append(n)
        held += b
    if len(groups) > 1 and held < nbytes / 4:
        tail = groups.pop()
        groups[-1] += tail
    return groups


def capped_groups(sizes, max_bytes):
    """mp.dist.buckets: consecutive groups of at most max_bytes (a larger tensor alone)."""
    groups, size = [[]], 0
    for n in sizes:
        if groups[-1] and size + n * FLOAT > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += n * FLOAT
    return groups if groups[0] else []


def bucket_numels(sizes, zero, bucket_mb, blocks=None, late=()):
    """Each bucket's element count (unpadded) over parameters given in registration order; blocks: --zero 3's
    one bucket a block (element counts per block). late: the indices (in sizes) of gradients complete only after
    the backward (mp.buckets' late: the gpt's tied weight), put last as mp.buckets puts them."""
    return [sum(g) for g, _ in bucket_groups(sizes, zero, bucket_mb, blocks, late)]


def bucket_groups(sizes, zero, bucket_mb, blocks=None, late=()):
    """[(the element counts of a bucket's parameters, whether it holds a late one)], in the order the buckets
    are made (mp.buckets: the backward's order, the late ones last)."""
    if zero == 3 and blocks is not None:   # a block a bucket; the late one's block waits for it
        starts = [sum(len(b) for b in blocks[:i]) for i in range(len(blocks))]
        return [(b, any(s <= j < s + len(b) for j in late)) for s, b in zip(starts, blocks) if b][::-1]
    order = [i for i in range(len(sizes))[::-1] if i not in late] + [i for i in range(len(sizes))[::-1] if i in late]
    backward = [sizes[i] for i in order]
    if zero >= 2:
        groups = capped_groups(backward, (bucket_mb or BUCKET_MB) * MB)
    else:
        total = sum(backward) * FLOAT
        kept = min(max(BUCKET_MB * MB, total / 2), KEPT_MAX_MB * MB) if bucket_mb is None else bucket_mb * MB
        groups = kept_groups(backward, kept)
    out, at = [], 0             # the groups keep the order and cut it into consecutive runs: map them back
    for g in groups:
        out.append((g, any(i in late for i in order[at:at + len(g)])))
        at += len(g)
    return [(g, is_late) for g, is_late in out if g]


def padded(n, parts):
    return -(-n // parts) * parts


def optimizer_bytes(tensors, optimizer, momentum):
    """mp.optim.optimizer_state_mb: SGD's momentum buffer (none at momentum 0), AdamW's two moments and its
    step counter (a float32 scalar a tensor)."""
    if optimizer == "adamw":
        return sum(2 * n * FLOAT + FLOAT for n in tensors)
    return sum(n * FLOAT for n in tensors) if momentum else 0


def collective(op, nbytes, n, backend):
    """Bytes one rank sends in one data-parallel collective of a flat bucket of nbytes (mp/traffic.py's count,
    floored as it floors): ring, the bytes a ring moves (mp.buckets.count); metered, what the functions called
    send (gloo: the reduce-scatter is an all-reduce, the all-gather n broadcasts)."""
    ring = (2 if op == "all_reduce" else 1) * (n - 1) * nbytes // n
    if op == "all_reduce" or backend == "nccl":
        metered = ring if op != "all_gather" else (n - 1) * (nbytes // n)
    else:
        metered = 2 * (n - 1) * nbytes // n if op == "reduce_scatter" else (n - 1) * (nbytes // n)
    return ring, metered


def bucket_ops(zero, microbatches, gather):
    """[(collective, times a step)] of one bucket under --zero (gather: --zero3-gather): ZeRO-2 and 3 reduce
    every microbatch, ZeRO-3 gathers the weights before the forward and the backward of each microbatch."""
    return {0: [("all_reduce", 1)], 1: [("reduce_scatter", 1), ("all_gather", 1)],
            2: [("reduce_scatter", microbatches), ("all_gather", 1)],
            3: [("reduce_scatter", microbatches),
                ("all_gather", 2 * microbatches if gather == "microbatch" else 1)]}[zero]


def bucket_traffic(buckets, n, zero, microbatches, gather, backend, late=()):
    """(ring bytes, metered bytes) a rank sends a step for its buckets (padded element counts); late: whether each
    holds a late gradient, reduced once after the backward even where the others go every microbatch."""
    ring = metered = 0
    for k, numel in enumerate(buckets):
        for op, times in bucket_ops(zero, microbatches, gather):
            times = 1 if op == "reduce_scatter" and k < len(late) and late[k] else times
            r, m = collective(op, numel * FLOAT, n, backend)
            ring, metered = ring + times * r, metered + times * m
    return ring, metered
