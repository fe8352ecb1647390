"""tensor_parallel.py on the vit with and without --sequence-parallel, per rank: what one block saves
for backward, the peak memory, the collectives of one step by kind and bytes, and the step time.

    python benchmarks/sequence_parallel.py --out logs/bench/sequence_parallel.json   # prints docs' tables

The driver runs, for each degree t, one torchrun of this file as a worker and two of
tensor_parallel.py (plain and --sequence-parallel, for their peak memory and their losses, which
must equal single_baseline.py's). The worker builds both models on every rank and measures:

* saved bytes: every tensor autograd saves during the forward of block 1 (a transformer block),
  counted once per storage, parameters left out (torch.autograd.graph.saved_tensors_hooks);
* collectives: torch.distributed's all_reduce, all_gather and reduce_scatter wrapped for one forward
  and backward; elements of the whole tensor each stands for (an all-reduce's tensor, an
  all-gather's output, a reduce-scatter's input), and the bytes a ring puts on the wire per rank:
  2(p-1)/p x 4 bytes per element for an all-reduce, (p-1)/p x 4 for the other two;
* step time: bench.race, the two engines taking turns, the order flipping every step.

In 3-D (`--cuts`): parallel_3d.py on 1 x 2 x 2 ranks, the vit of SIZE and an mlp, with each way a
pipeline cut can travel (whole from every tp rank, scatter/gather, the sequence-parallel token
shard), run under bench_3d.py's counting wrappers: bytes per step on each axis for every rank
(counted, next to bench_3d's formula), peak memory, median step time, and the largest |loss -
baseline| over the run.

    python benchmarks/sequence_parallel.py --cuts --out logs/bench/cuts.json
"""
import argparse
import json
import os
import subprocess
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]  # the repository root, and bench.py beside this file

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tensor_parallel as tp  # noqa: E402
from bench import one_step, race  # noqa: E402
from tp_hybrid import counted_collectives  # noqa: E402
from mp.dist import distributed, exit_now
from mp.flags import OneLineParser, base_parser
from mp.models import build_model
from mp.optim import make_optimizer
from mp.data import SyntheticData

SIZE = ["--model", "vit", "--hidden", "256", "--heads", "8", "--layers", "4", "--batch-size", "64"]
WIRE = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}   # ring: elements sent per (p-1)/p element


def saved_bytes_of_block(model, x, index=1):
    """Bytes of the activations block `index` saves for backward (parameters left out), for input x."""
    with torch.no_grad():
        h = model[:index](x)
    h.requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model[index](h)
    return sum(storages.values())


def collectives_of_one_step(model, x, y):
    """{"phase kind": elements} and {"phase kind": calls} of one forward and backward."""
    elements, calls, phase = Counter(), Counter(), ["forward"]
    targets = [t for t in counted_collectives() if t[2] in WIRE]
    originals = {(module, name): getattr(module, name) for module, name, _ in targets}

    def counting(module, name, kind):
        def wrapper(*args, **kwargs):
            # the whole tensor: an all-gather's output, a reduce-scatter's input (a list or one flat buffer)
            whole = args[0] if kind != "reduce_scatter" else args[1]
            elements[f"{phase[0]} {kind}"] += sum(t.numel() for t in whole) if isinstance(whole, list) else whole.numel()
            calls[f"{phase[0]} {kind}"] += 1
            return originals[(module, name)](*args, **kwargs)
        return wrapper

    for module, name, kind in targets:
        setattr(module, name, counting(module, name, kind))
    try:
        loss = F.cross_entropy(model(x), y)
        phase[0] = "backward"
        loss.backward()
        tp.sync_tp_grads(getattr(model, "partial_grads", None), None)   # the step's sums after the backward (the norms')
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    model.zero_grad(set_to_none=True)
    return dict(elements), dict(calls)


def wire_bytes(elements, degree):
    return sum(4 * WIRE[key.split()[1]] * (degree - 1) / degree * n for key, n in elements.items())


def worker(argv):
    p = base_parser(__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    args.data, args.eval_every = "synthetic", 0
    with distributed(args) as env:
        group, degree = dist.group.WORLD, env.world_size
        batches = [SyntheticData(args.seed).batch(s, args.batch_size) for s in range(4)]
        result, engines = {"degree": degree}, {}
        for name, sequence in (("tp", False), ("sp", True)):
            model = tp.parallelize(build_model(args), "vit", group, sequence_parallel=sequence)
            elements, calls = collectives_of_one_step(model, *batches[0])
            result[name] = {"saved_bytes_block": saved_bytes_of_block(model, batches[0][0]), "elements": elements,
                            "calls": calls, "wire_bytes_per_rank": wire_bytes(elements, degree)}
            optimizer = make_optimizer(model.parameters(), args)
            engines[name] = one_step(model, optimizer)
        raced = race(engines, batches, args.warmup, args.repeat, env.device, reference="tp")
        for name in engines:
            result[name]["median_step_s"] = raced[name][0]
        result["paired_sp_over_tp"] = race.paired["sp"]
        every = [None] * degree
        dist.all_gather_object(every, {n: result[n]["saved_bytes_block"] for n in ("tp", "sp")})
        result["saved_bytes_block_per_rank"] = every
        if env.rank == 0:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


def torchrun(nproc, argv):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--", *argv]
    run = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{run.stderr[-3000:]}")


def losses_and_summary(path):
    records = [json.loads(line) for line in open(path)]
    return [r["loss"] for r in records if r["event"] == "train"], next(r for r in records if r["event"] == "summary")


def driver(out, degrees=(2, 4), steps=10):
    os.makedirs(out + ".d", exist_ok=True)
    flags = SIZE + ["--data", "synthetic", "--eval-every", "0", "--steps", str(steps)]
    base_log = os.path.join(out + ".d", "baseline.jsonl")
    subprocess.run([sys.executable, "single_baseline.py", *flags, "--log-file", base_log], cwd=ROOT, check=True,
                   capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    baseline, _ = losses_and_summary(base_log)
    result = {"size": SIZE, "steps": steps}
    for t in degrees:
        w = os.path.join(out + ".d", f"worker{t}.json")
        torchrun(t, [os.path.join("benchmarks", "sequence_parallel.py"), "--worker", *SIZE, "--out", w])
        result[t] = json.load(open(w))
        for name, extra in (("tp", []), ("sp", ["--sequence-parallel"])):
            log = os.path.join(out + ".d", f"{name}{t}.jsonl")
            torchrun(t, ["tensor_parallel.py", *flags, *extra, "--log-file", log])
            losses, summary = losses_and_summary(log)
            result[t][name]["peak_memory_mb"] = summary["peak_memory_mb"]
            result[t][name]["max_loss_diff_vs_baseline"] = max(abs(a - b) for a, b in zip(losses, baseline))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    report(result, degrees)


def report(result, degrees):
    for t in degrees:
        r = result[t]
        print(f"degree {t}:")
        for name in ("tp", "sp"):
            s = r[name]
            print(f"  {name}: block saves {s['saved_bytes_block'] / 2**20:.2f} MiB per rank; peak RSS "
                  f"{s['peak_memory_mb']} MB; {s['wire_bytes_per_rank'] / 2**20:.2f} MiB on the wire per rank; "
                  f"step {s['median_step_s'] * 1e3:.0f} ms; |loss - baseline| <= {s['max_loss_diff_vs_baseline']:.2g}")
            print(f"      calls {s['calls']}\n      elements {s['elements']}")
        print(f"  sp / tp step time (median of per-step ratios): {r['paired_sp_over_tp']:.2f}")


MLP = ["--model", "mlp", "--hidden", "1024", "--layers", "4", "--batch-size", "64"]
CUTS = [   # (model flags, option flags, bench_3d formula keywords)
    (SIZE, ["--no-scatter-gather"], {"scatter_gather": False}),
    (SIZE, [], {}),
    (SIZE, ["--sequence-parallel"], {"sequence_parallel": True}),
    (MLP, ["--no-scatter-gather"], {"scatter_gather": False}),
    (MLP, [], {}),
]


def cuts(out, steps=10):
    """parallel_3d.py, dp 1 x pp 2 x tp 2, each cut option: counted bytes per axis, formula, memory, time."""
    import bench_3d
    folder = out + ".d"
    os.makedirs(folder, exist_ok=True)
    rows, result = [], []
    for size, option, keywords in CUTS:
        flags = size + ["--data", "synthetic", "--eval-every", "0", "--steps", str(steps)]
        base_log = os.path.join(folder, f"baseline-{size[1]}.jsonl")
        if not os.path.exists(base_log):
            subprocess.run([sys.executable, "single_baseline.py", *flags, "--log-file", base_log], cwd=ROOT,
                           check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        traffic = os.path.join(folder, "traffic-" + "-".join([size[1], *option]).replace("--", ""))
        os.makedirs(traffic, exist_ok=True)
        log = traffic + ".jsonl"
        bench_3d.torchrun(4, [os.path.join(HERE, "bench_3d.py"), "traffic", *flags, "--dp", "1", "--tp", "2",
                              "--microbatches", "2", *option, "--log-file", log], {"TRAFFIC_DIR": traffic})
        losses, summary = losses_and_summary(log)
        baseline, _ = losses_and_summary(base_log)
        b, hidden = int(size[size.index("--batch-size") + 1]), int(size[size.index("--hidden") + 1])
        formula = bench_3d.vit_formula(b, 2, hidden, int(size[size.index("--layers") + 1]), **keywords) \
            if size[1] == "vit" else bench_3d.mlp_formula(b, 2, hidden, **keywords)
        counted = [bench_3d.counted(traffic, rank, steps) for rank in range(4)]
        result.append({"model": size[1], "option": option, "counted": counted, "formula": formula,
                       "peak_memory_mb": summary["peak_memory_mb"], "median_step_s": summary["median_step_time_s"],
                       "max_loss_diff_vs_baseline": max(abs(x - y) for x, y in zip(losses, baseline))})
        r = result[-1]
        for stage in (0, 1):
            got = {axis: {counted[rank][axis] for rank in (2 * stage, 2 * stage + 1)} for axis in ("tp", "pp")}
            rows.append(f"| {size[1]} | {' '.join(option) or 'scatter/gather (default)'} | {stage} | "
                        + " | ".join(f"{formula[a][stage]:,} / {' '.join(f'{v:,.0f}' for v in got[a])}"
                                     for a in ("tp", "pp"))
                        + f" | {' / '.join(str(r['peak_memory_mb'][str(k)]) for k in (2 * stage, 2 * stage + 1))}"
                        + f" | {r['median_step_s'] * 1e3:.0f} | {r['max_loss_diff_vs_baseline']:.2g} |")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("| model | cut | stage | tp bytes/step/rank: formula / counted | pp: formula / counted "
          "| peak RSS (MB), the stage's 2 ranks | median step (ms) | largest \\|loss - baseline\\| |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


def parse_driver(argv):
    """The driver's flags (a worker's are base_parser's): --help answers, a mistyped flag is one error: line."""
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cuts", action="store_true", help="3-D: each way a pipeline cut can travel (parallel_3d.py)")
    p.add_argument("--out", help="the JSON written (default: logs/bench/sequence_parallel.json; with --cuts, "
                                 "logs/bench/cuts.json)")
    return p.parse_args(argv)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        exit_now(worker(sys.argv[1:]))
    args = parse_driver(sys.argv[1:])
    if args.cuts:
        sys.exit(cuts(os.path.abspath(args.out or "logs/bench/cuts.json")))
    driver(os.path.abspath(args.out or "logs/bench/sequence_parallel.json"))
