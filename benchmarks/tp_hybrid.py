"""Plain tensor parallelism against --hybrid (Krizhevsky's one weird trick) on the cnn: the collectives
of one training step, counted, with the elements each moves; then the step time of both and of the
single-process baseline, stepped in turns in the same torchrun processes.

    torchrun --standalone --nproc-per-node 2 -- benchmarks/tp_hybrid.py --out logs/bench/hybrid2.json
    torchrun --standalone --nproc-per-node 4 -- benchmarks/tp_hybrid.py --out logs/bench/hybrid4.json

Counting wraps torch.distributed's collectives for one step (count_collectives). Timing is bench.py's
race: a timed step is barrier, one optimizer step, barrier (rank 0's clock); the three engines take
turns, the order flipping every step, so a noisy neighbour on shared cores hits them alike; each
trains its own copy of the same model on the same batches, so their losses must agree.
"""
import json
import os
import sys
from contextlib import contextmanager

import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository root, and bench.py beside this file

import tensor_parallel as tp  # noqa: E402
from bench import baseline_engine, loss_diff, model_args, one_step, race  # noqa: E402
from mp.dist import distributed, exit_now
from mp.flags import base_parser
from mp.models import build_model
from mp.optim import make_optimizer
from mp.data import SyntheticData
from mp.tp import collectives

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@contextmanager
def count_collectives(phase):
    """Record (phase[0], collective, elements) for each torch.distributed collective called inside;
    the caller sets phase[0] ("forward", "backward") as it goes. Elements: the tensor of an
    all-reduce, the whole gathered output of an all-gather (padding included)."""
    calls, originals = [], {(module, n): getattr(module, n) for module, n, _ in counted_collectives()}

    def counting(module, name, kind):
        def wrapper(*args, **kwargs):
            out = kwargs.get("tensor_list", args[0] if args else None)   # a flat gather's args[0]: its whole output
            calls.append((phase[0], kind, sum(t.numel() for t in out) if isinstance(out, list) else out.numel()))
            return originals[(module, name)](*args, **kwargs)
        return wrapper

    for module, name, kind in counted_collectives():
        setattr(module, name, counting(module, name, kind))
    try:
        yield calls
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def counted_collectives():
    """(module, name, kind) of every collective to count: torch.distributed's, and the flat-buffer gather
    and scatter that mp.tp.collectives bound at import (so wrapping torch.distributed's names misses them)."""
    return [(dist, n, n) for n in COLLECTIVES] + [(collectives, "ALL_GATHER", "all_gather"),
                                                 (collectives, "REDUCE_SCATTER", "reduce_scatter")]


def collectives_of_one_step(model, x, y):
    """[(phase, collective, elements)] of one forward and backward of `model` on (x, y)."""
    phase = ["forward"]
    with count_collectives(phase) as calls:
        loss = F.cross_entropy(model(x), y)
        phase[0] = "backward"
        loss.backward()
        tp.sync_tp_grads(getattr(model, "partial_grads", None), None)   # the step's sums after the backward (the conv bucket)
    model.zero_grad(set_to_none=True)
    return calls


def bytes_per_rank(calls, degree):
    """Bytes each rank sends in ring collectives of float32: an all-reduce of M elements 2(p-1)/p*M,
    an all-gather of M elements in all (p-1)/p*M."""
    factor = {"all_reduce": 2, "all_gather": 1}
    return sum(4 * factor[name] * (degree - 1) / degree * n for _, name, n in calls)


def engine(margs, group, hybrid):
    model = tp.parallelize(build_model(margs), "cnn", group, hybrid)
    optimizer = make_optimizer(model.parameters(), margs)
    return model, one_step(model, optimizer)


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=40)
    args = p.parse_args(argv)
    args.data, args.eval_every, args.model = "synthetic", 0, "cnn"
    with distributed(args) as env:
        group, margs = dist.group.WORLD, model_args(args, "cnn")
        data = SyntheticData(args.seed)
        batches = [data.batch(s, args.batch_size) for s in range(4)]
        plain, plain_step = engine(margs, group, hybrid=False)
        hybrid, hybrid_step = engine(margs, group, hybrid=True)
        result = {"degree": env.world_size, "batch_size": args.batch_size, "collectives": {}}
        for name, model in (("tp", plain), ("hybrid", hybrid)):
            calls = collectives_of_one_step(model, *batches[0])
            result["collectives"][name] = {"calls": calls, "bytes_per_rank": bytes_per_rank(calls, env.world_size)}
        engines = {"baseline": baseline_engine(margs, env), "tp": plain_step, "hybrid": hybrid_step}
        raced = race(engines, batches, args.warmup, args.repeat, env.device, reference="tp")  # turns, order flipping each step
        result["median_step_s"] = {n: seconds for n, (seconds, _) in raced.items()}
        result["paired_hybrid_over_tp"] = race.paired["hybrid"]  # median of the per-step ratios
        result["max_loss_diff_vs_baseline"] = {n: loss_diff(raced[n][1], raced["baseline"][1]) for n in ("tp", "hybrid")}
        if env.rank == 0:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(json.dumps({k: v for k, v in result.items() if k != "collectives"}), flush=True)
            for name, c in result["collectives"].items():
                print(name, len(c["calls"]), "collectives", c["calls"], f"{c['bytes_per_rank']:.0f} bytes per rank")
    return 0


if __name__ == "__main__":
    exit_now(main())  # skip gloo's destructors (mp.dist.exit_now)
