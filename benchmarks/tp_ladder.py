"""The course's tensor-parallel ladder on its own model, Sequential(linear1, relu, linear2) (our
`--model mlp --layers 2 --activation relu`), built from tensor_parallel.py's layers, each rung
compared with the full layers in the same process and its collectives counted:

    1  one layer split by columns   ColumnParallelLinear(linear1), its output gathered
    1b one layer split by rows      RowParallelLinear(linear1) on my slice of the input features
    2  the Sequential, one round    linear1 by columns, relu on my neurons, linear2 by rows: one all-reduce
    2b the Sequential, column-only  both by columns, each output gathered: what the pair saves
    3  a norm                       LayerNorm after the pair's all-reduce: whole features, replicated
    4  curves                       the pair, the column-only and the full model trained side by side

    python benchmarks/tp_ladder.py                                   # degree 2: the table, 100 steps
    python benchmarks/tp_ladder.py --nproc 2 --steps 300 --plot plots/tp_ladder.png

The ranks are spawned here (gloo, one thread each). Every rank builds the full model from --seed and
slices it, as tensor_parallel.py's parallelize() does; the full model stays on every rank as the
reference. Collectives are counted as tests/test_tensor_parallel.py counts them, with
benchmarks/sequence_parallel.py's collectives_of_one_step (calls and elements per phase); wire
bytes are a ring's per rank: 2(t-1)/t x 4 bytes an element for an all-reduce, (t-1)/t x 4 for an
all-gather.
"""
import argparse
import copy
import os
import queue
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository root, and the benchmarks beside this file

import tensor_parallel as tp  # noqa: E402
from bench import one_step  # noqa: E402
from mp.models import build_model
from mp.optim import make_optimizer
from mp.data import SyntheticData
from mp.flags import OneLineParser
from sequence_parallel import collectives_of_one_step, wire_bytes  # noqa: E402


class Sliced(nn.Module):
    """A layer that sees only my slice of its input's features (a row split's input, made whole here)."""

    def __init__(self, layer, group):
        super().__init__()
        self.layer, self.group = layer, group

    def forward(self, x):
        x = x.flatten(1)
        sizes = tp.split_sizes(x.shape[1], tp.tp_size(self.group))
        return self.layer(x.narrow(1, sum(sizes[:tp.tp_rank(self.group)]), sizes[tp.tp_rank(self.group)]))


def rungs(full, group):
    """{name: (parallel model, the full model it must equal)}: each built from copies of the full layers."""
    fc1, relu, fc2 = full[0][1], full[0][2], full[1][0]
    c = copy.deepcopy
    normed = nn.Sequential(nn.Flatten(), c(fc1), nn.ReLU(), nn.Linear(fc1.out_features, fc1.out_features),
                           nn.LayerNorm(fc1.out_features), c(fc2))
    return {
        "1 one layer, columns": (
            nn.Sequential(nn.Flatten(), tp.ColumnParallelLinear(c(fc1), group, gather_output=True)),
            nn.Sequential(nn.Flatten(), c(fc1))),
        "1b one layer, rows": (Sliced(tp.RowParallelLinear(c(fc1), group), group),
                               nn.Sequential(nn.Flatten(), c(fc1))),
        "2 Sequential, column + row": (pair(full, group), c(full)),
        "2b Sequential, column-only": (column_only(full, group), c(full)),
        "3 with a LayerNorm": (nn.Sequential(nn.Flatten(), tp.ColumnParallelLinear(c(normed[1]), group), relu,
                                             tp.RowParallelLinear(c(normed[3]), group), c(normed[4]),
                                             tp.ColumnParallelLinear(c(normed[5]), group, gather_output=True)),
                               normed),
    }


def pair(full, group):
    """tensor_parallel.py's own split of the mlp: linear1 by columns, linear2 by rows."""
    return tp.parallelize(copy.deepcopy(full), "mlp", group)


def column_only(full, group):
    """Both layers by columns: linear1's output gathered so that linear2 sees every feature, and
    linear2's gathered into whole logits; an all-gather each way, and linear2's f all-reduces dL/dX."""
    fc1, relu, fc2 = (copy.deepcopy(m) for m in (full[0][1], full[0][2], full[1][0]))
    model = nn.Sequential(nn.Flatten(), tp.ColumnParallelLinear(fc1, group, gather_output=True), relu,
                          tp.ColumnParallelLinear(fc2, group, gather_output=True))
    model.dropout_keys = full.dropout_keys   # train_step sets its step (no dropout here: p = 0)
    return model


def largest_difference(model, reference, x, y):
    """max |difference| of the output and of every parameter's gradient, mine against my slice of
    the full one (the two models list their parameters in the same order)."""
    outputs = []
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        outputs.append(m(x))
        F.cross_entropy(outputs[-1], y).backward()
    worst = (outputs[0] - outputs[1]).abs().max().item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        module, _, param = name.rpartition(".")
        shard = getattr(model.get_submodule(module), "shards", {}).get(param)   # None: replicated
        worst = max(worst, (p.grad - (q.grad if shard is None else q.grad.narrow(*shard))).abs().max().item())
    return worst


def curves(args, full, group):
    """Losses of the full model, the pair and the column-only, trained on the same batches."""
    models = {"full": copy.deepcopy(full), "pair": pair(full, group), "column-only": column_only(full, group)}
    steps = {n: one_step(m, make_optimizer(m.parameters(), args)) for n, m in models.items()}
    data, losses = SyntheticData(args.seed), {n: [] for n in models}
    for s in range(args.steps):
        x, y = data.batch(s, args.batch_size)
        for name, step in steps.items():
            losses[name].append(step(x, y))
    return losses


def worker(rank, world, init, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    group = dist.group.WORLD
    full = build_model(args)
    x, y = SyntheticData(args.seed).batch(0, args.batch_size)
    table = {}
    for name, (model, reference) in rungs(full, group).items():
        diff = torch.tensor([largest_difference(model, reference, x, y)])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)   # the worst rank's
        elements, calls = collectives_of_one_step(model, x, y)
        table[name] = {"largest_difference": diff.item(), "calls": calls, "elements": elements,
                       "wire_bytes_per_rank": wire_bytes(elements, world)}
    losses = curves(args, full, group)
    if rank == 0:
        out.put({"table": table, "losses": losses})
    dist.barrier()
    dist.destroy_process_group()


def print_table(result, degree):
    print(f"\n| rung (degree {degree}) | collectives of one step (calls: forward; backward) | elements | "
          f"wire bytes per rank | largest difference vs full |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in result["table"].items():
        calls = "; ".join(", ".join(f"{n} {k.split()[1]}" for k, n in sorted(row["calls"].items())
                                    if k.startswith(phase)) or "none" for phase in ("forward", "backward"))
        print(f"| {name} | {calls} | {sum(row['elements'].values()):,} | {row['wire_bytes_per_rank']:,.0f} | "
              f"{row['largest_difference']:.2e} |")
    full = result["losses"]["full"]
    for name in ("pair", "column-only"):
        worst = max(abs(a - b) for a, b in zip(result["losses"][name], full))
        print(f"{name}: {len(full)} steps, largest |loss - full model's loss| {worst:.2e}, last loss "
              f"{result['losses'][name][-1]:.4f} (full: {full[-1]:.4f})")


CONTRACT = 1e-4   # the programs' equivalence contract: |loss - baseline loss| <= 1e-4 at every step


def plot(result, args, out):
    """Loss curves (left) and |loss - full model's| (right) with the contract's 1e-4 line: ReLU's
    kinks let the rounding difference cross it where GELU's model stays far below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from mp.tools.figure import save
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    full = result["losses"]["full"]
    left.plot(full, lw=3, color="black", alpha=0.3, label="full model, one process [baseline]")
    for name, style in (("pair", "--"), ("column-only", ":")):
        losses = result["losses"][name]
        left.plot(losses, ls=style, lw=1.2, label=f"{name}, {args.nproc} ranks")
        right.semilogy([max(abs(a - b), 1e-9) for a, b in zip(losses, full)], ls=style, label=name)
    right.axhline(CONTRACT, color="red", lw=1, ls="-.", label="1e-4: the programs' equivalence contract")
    left.set(xlabel="step (from 0)", ylabel="training loss", title="loss")
    right.set(xlabel="step (from 0)", ylabel="|loss - full model's| (floor 1e-9)", title="difference")
    for ax in (left, right):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))   # whole steps
        ax.legend()
    fig.suptitle(f"the course's Sequential(linear1, relu, linear2): mlp --layers 2 --hidden {args.hidden} "
                 f"--activation relu\nSYNTHETIC data, batch {args.batch_size}, {args.steps} steps, lr {args.lr}, "
                 f"seed {args.seed}; degree {args.nproc}")
    save(fig, out, {"kind": "tp_ladder", "args": vars(args), "table": result["table"], "contract": CONTRACT,
                    "largest_difference": {n: max(abs(a - b) for a, b in zip(result["losses"][n], full))
                                           for n in ("pair", "column-only")}})
    return fig


def ladder(args):
    """Spawn args.nproc gloo ranks, run every rung and the curves; rank 0's {"table", "losses"}."""
    margs = argparse.Namespace(model="mlp", layers=2, hidden=args.hidden, heads=1, activation="relu", dropout=0.0,
                               seed=args.seed, lr=args.lr, momentum=0.9, batch_size=args.batch_size, steps=args.steps)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, args.nproc, os.path.join(tmp, "init"), margs, out))
                 for r in range(args.nproc)]
        for proc in procs:
            proc.start()
        result = None
        while result is None:   # a rank that dies never puts its result: stop then, naming it, not hang
            try:
                result = out.get(timeout=1)
            except queue.Empty:
                dead = [r for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
                if dead:
                    for proc in procs:
                        proc.kill()
                    sys.exit(f"error: rank {dead[0]} of the ladder exited with status {procs[dead[0]].exitcode} "
                             f"(its traceback is above)")
        for proc in procs:
            proc.join()
    return result


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="tensor-parallel degree (ranks spawned here)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="draw the curves into this PNG")
    return p.parse_args(argv)


def main():
    args = parse_args()
    result = ladder(args)
    print_table(result, args.nproc)
    if args.plot:
        plot(result, args, args.plot)


if __name__ == "__main__":
    main()
