"""--search: every legal layout of a model on a cluster that fits its memory, ranked by predicted step time.

The space is pruned the way the axes' costs suggest, so that 16,384 GPUs take seconds: tp among the divisors of
the heads within one node (its all-reduces run every layer: across nodes they would dominate), cp among the
powers of two that divide the sequence, pp among the stage counts the layers allow, dp what the GPUs leave; ep
among the divisors of the experts that divide dp x cp x tp; then ZeRO 1-3, the schedule, the recompute and the
microbatch size. Each candidate costs a few formulas (mp.plan.predict), no simulation."""
from dataclasses import replace

from mp.plan.predict import plan


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def legal(m, lay, c):
    """None, or why the layout cannot run (the numbers in the sentence)."""
    if lay.world != c.gpus:
        return (f"dp {lay.dp} x tp {lay.tp} x pp {lay.pp} x cp {lay.cp} = {lay.world} does not use the {c.gpus} GPUs; "
                f"make the product {c.gpus}")
    if m.heads % lay.tp or m.kv % lay.tp:
        return (f"tp {lay.tp} does not divide the {m.heads} heads ({m.kv} key/value heads); "
                f"use tp among {divisors(m.kv)}")
    if lay.pp * lay.virtual_stages > m.layers:
        return (f"pp {lay.pp} x {lay.virtual_stages} virtual stages = {lay.pp * lay.virtual_stages} chunks for "
                f"{m.layers} layers: every chunk needs one; use pp at most {m.layers // lay.virtual_stages}")
    if m.tokens % (lay.cp * (lay.tp if lay.sequence_parallel else 1)):
        split = lay.cp * (lay.tp if lay.sequence_parallel else 1)
        return (f"the sequence of {m.tokens} tokens is not divisible by cp {lay.cp}"
                + (f" x tp {lay.tp} (sequence parallel)" if lay.sequence_parallel and lay.tp > 1 else "")
                + f" = {split}; use a cp that divides {m.tokens // (lay.tp if lay.sequence_parallel else 1)}")
    if lay.global_batch % (lay.dp * lay.microbatch):
        return (f"the global batch {lay.global_batch} is not divisible by dp {lay.dp} x microbatch {lay.microbatch}; "
                f"use a global batch that is a multiple of {lay.dp * lay.microbatch}")
    if m.experts and (m.experts % lay.ep or (lay.dp * lay.cp * lay.tp) % lay.ep):
        return f"ep {lay.ep} must divide the {m.experts} experts and dp x cp x tp = {lay.dp * lay.cp * lay.tp}"
    if not m.experts and lay.ep > 1:
        return f"ep {lay.ep} spreads experts, and the model is dense; drop --ep"
    if lay.schedule == "interleaved" and lay.microbatches % lay.pp:
        return f"interleaved needs the {lay.microbatches} microbatches a multiple of pp {lay.pp}"
    return None


def candidates(m, c, base):
    """Every layout the pruned space holds (legal or not: search() filters)."""
    tps = [t for t in divisors(m.kv) if t <= c.gpus_per_node and c.gpus % t == 0]
    cps = [k for k in (1, 2, 4, 8, 16, 32) if m.tokens % k == 0 and m.tokens // k >= 1024 or k == 1]
    for t in tps:
        for k in cps:
            rest = c.gpus // (t * k) if c.gpus % (t * k) == 0 else 0
            for p in [p for p in divisors(rest) if p <= m.layers] if rest else []:
                d = rest // p
                for e in [e for e in divisors(m.experts) if (d * k * t) % e == 0] if m.experts else [1]:
                    for sched, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)) if p > 1 else (("1f1b", 1),):
                        for z in (1, 2, 3):
                            for rc in ("none", "selective", "full"):
                                for b in (1, 2, 4):
                                    yield replace(base, dp=d, tp=t, pp=p, cp=k, ep=e, zero=z, schedule=sched,
                                                  virtual_stages=v, recompute=rc, microbatch=b)


def search(m, c, base, top=10):
    """(the ranked plans that fit, how many layouts were legal)."""
    fits, n = [], 0
    for lay in candidates(m, c, base):
        if legal(m, lay, c):
            continue
        n += 1
        r = plan(m, lay, c)
        if r["fits"]:
            fits.append(r)
    fits.sort(key=lambda r: (round(r["step_s"], 6), r["memory_gb"]))   # a tie: the one that holds less
    return fits[:top], n


def why(best, nxt):
    """One sentence: where the best layout's predicted time goes less than the next one's."""
    a, b = best["time_parts_s"], nxt["time_parts_s"]
    gains = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    said = ", ".join(f"{k} {b[k] - a[k]:+.3f} s" for d, k in gains if d > 1e-4)[:200]
    if not said:
        return (f"the best and the next take the same predicted time ({best['step_s']:.3f} s); the best holds "
                f"{nxt['memory_gb'] - best['memory_gb']:.1f} GB less on its largest rank")
    return (f"the best is {nxt['step_s'] - best['step_s']:.3f} s a step faster than the next: it saves {said} "
            f"(the next's parts minus the best's)")
