"""Benchmark worker: our engines and PyTorch's, stepped alternately in the same torchrun processes.

Launched by benchmarks/report.py (which writes docs/benchmarks.md); by hand:

    torchrun --standalone --nproc-per-node 4 -- benchmarks/bench.py pipeline --out logs/bench/pp.json
    torchrun --standalone --nproc-per-node 2 -- benchmarks/bench.py tp --out logs/bench/tp2.json

Every engine trains its own copy of the same model (mp.models.build_model, same --seed) on the same
sequence of global batches, so the losses of the engines must agree step by step (a sanity check
reported as max_loss_diff). A timed step is: barrier, start clock, one optimizer step, barrier, stop
clock (rank 0's clock), so every engine pays the same two barriers. The engines take turns step by
step (the order flips every step), so a noisy neighbour on the shared cores hits them alike.

Backend and device are the programs' (--backend, default auto): gloo on the CPU, or nccl with
every engine, batch and baseline on the rank's GPU; the output records which (backend, device).
Only the CPU has been run (docs/gpu.md).
"""
import contextlib
import io
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import pipeline_microbatch as pm  # noqa: E402
from mp.pp.schedules import placement_of, schedule_actions, virtual_stage  # noqa: E402
from mp.pp.timeline import gather_timeline  # noqa: E402
import single_baseline  # noqa: E402
import tensor_parallel as tp  # noqa: E402
from mp.dist import clock, distributed, torchrun_env  # noqa: E402
from mp.errors import fail  # noqa: E402
from mp.flags import base_parser  # noqa: E402
from mp.models import build_model  # noqa: E402
from mp.optim import make_optimizer  # noqa: E402
from mp.data import SyntheticData  # noqa: E402


def parse_args(argv=None):
    p = base_parser(__doc__)
    p.add_argument("what", choices=["pipeline", "tp"])
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--configs", default=None, help="pipeline: model:m:schedule,... (default: the issue's grid)")
    p.add_argument("--bubble", default="4,8,16,32", help="pipeline: microbatch counts for the bubble table ('' = none)")
    # the configs name their models; --layers and --hidden size the mlp (the tp benchmark's model too)
    p.set_defaults(model="mlp")
    args = p.parse_args(argv)
    args.data, args.eval_every = "synthetic", 0
    counts = sorted({split_config(c)[1] for c in pipeline_grid(args)} | set(bubble_counts(args)))
    uneven = [m for m in counts if args.batch_size % m]
    if args.what == "pipeline" and uneven:
        fail(f"--batch-size {args.batch_size} does not split into {uneven} microbatches; "
             f"use a multiple of {math.lcm(*counts)}")
    validate_runs(args)
    return args


def validate_runs(args):
    """Every run the benchmark will make, checked by the program it stands for, as that program
    checks its own flags (pipeline_microbatch.parse_args, tensor_parallel.parse_args, at this
    WORLD_SIZE) before any engine is built: a config the program refuses (a 6-block mlp cut into
    4 stages x 2 virtual stages) is one error line naming the config, not an IndexError mid-run."""
    if args.what == "tp":
        runs = [(f"mlp:tp{torchrun_env('gloo').world_size}", tp.parse_args, program_argv(args, "mlp"))]
    else:
        runs = [(f"--configs {c}", pm.parse_args, program_argv(args, *split_config(c))) for c in pipeline_grid(args)]
        runs += [(f"--bubble {m} (mlp, {s})", pm.parse_args, program_argv(args, "mlp", m, s))
                 for m in bubble_counts(args) for s in BUBBLE]
    for name, parse, argv in runs:
        refusal = own_check(parse, argv)
        if refusal is not None:
            fail(f"{name}: {refusal}")


def own_check(parse, argv):
    """None if the program's parse_args accepts argv, else its error line (without "error: "); its
    own line is kept back, so that the benchmark prints one line that names the config."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parse(argv)
    except SystemExit:
        lines = said.getvalue().strip().splitlines() or ["refused (another rank says why)"]
        return lines[-1].split("error: ", 1)[-1]
    return None


def program_argv(args, model, m=None, schedule=None):
    """The program's flags for one run of the benchmark: the sizes and training settings given here."""
    argv = ["--model", model, "--batch-size", str(args.batch_size), "--seed", str(args.seed),
            "--momentum", str(args.momentum), "--data", "synthetic", "--backend", args.backend]
    argv += ["--lr", str(args.lr)] if args.lr is not None else []   # None: the optimizer's default
    for flag in SIZE_FLAGS[model]:        # only the sizes this model reads (the cnn has none)
        argv += [f"--{flag}", str(getattr(args, flag))]
    if schedule is not None:
        argv += ["--microbatches", str(m), "--schedule", schedule]
        argv += ["--virtual-stages", "2"] if schedule in ("interleaved", "zbv") else []   # as model_args sets it
    return argv


SIZE_FLAGS = {"cnn": (), "mlp": ("layers", "hidden"), "vit": ("layers", "hidden", "heads")}


def split_config(config):
    """model:m:schedule -> (model, m, schedule), or one error line saying what a config looks like."""
    parts = config.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) < 1 or parts[2] not in RACED:
        fail(f"--configs {config!r}: a config is model:microbatches:schedule, microbatches positive, a schedule among "
             f"{', '.join(RACED)}, e.g. mlp:8:1f1b")
    return parts[0], int(parts[1]), parts[2]


def pipeline_grid(args):
    """The pipeline configs to race: --configs, or the issue's grid (no interleaved or zbv cnn: 5 blocks, 8 chunks)."""
    if args.configs:
        return args.configs.split(",")
    return [f"{model}:{m}:{s}" for model in ("mlp", "cnn") for m in (8, 32) for s in RACED
            if not (model == "cnn" and s in ("interleaved", "zbv"))]


def bubble_counts(args):
    counts = [s for s in args.bubble.split(",") if s]
    if not all(s.isdigit() and int(s) > 0 for s in counts):
        fail(f"--bubble {args.bubble!r} must be positive microbatch counts separated by commas, e.g. 4,8 ('' for none)")
    return [int(s) for s in counts]


def model_args(args, model, schedule="1f1b", m=1):
    a = base_parser("").parse_args([])
    a.__dict__.update(model=model, layers=args.layers, hidden=args.hidden, seed=args.seed, lr=args.lr,
                      momentum=args.momentum, batch_size=args.batch_size, microbatches=m, schedule=schedule,
                      virtual_stages=2, balance=None)
    return a


def timed(fn, device):
    """One step between two barriers; returns (seconds, fn's result). On a GPU the clock stops after
    the queued kernels have run (mp.dist.clock)."""
    dist.barrier()
    start = clock(device)
    result = fn()
    dist.barrier()
    return clock(device) - start, result


def race(engines, batches, warmup, repeat, device, reference="torch"):
    """engines: name -> step(x, y) returning the loss (or None off the loss rank). Steps alternate,
    the order flipping every step. Returns name -> (median seconds, losses)."""
    times = {n: [] for n in engines}
    losses = {n: [] for n in engines}
    names = list(engines)
    for step in range(warmup + repeat):
        x, y = batches[step % len(batches)]
        for name in (names if step % 2 == 0 else names[::-1]):
            seconds, loss = timed(lambda: engines[name](x, y), device)
            losses[name].append(loss)
            if step >= warmup:
                times[name].append(seconds)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)           # the loss lives on the last stage, the baseline's on rank 0
    losses = {n: next((r[n] for r in every if r[n][0] is not None), losses[n]) for n in names}
    race.paired = {n: statistics.median(a / b for a, b in zip(times[n], times[reference])) for n in names}
    return {n: (statistics.median(times[n]), losses[n]) for n in names}


def loss_diff(a, b):
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return max((abs(x - y) for x, y in pairs), default=None)


# ----------------------------------------------------------------------------- pipeline engines


def ours_pipeline(margs, env, pos):
    model, runner = pm.setup_stage(margs, env, pos)
    actions = schedule_actions(margs.schedule, pos, margs.microbatches, sends_at_once=runner.messenger.sends_at_once)
    params = [p for chunk in runner.chunks for p in chunk.parameters()]
    opt = make_optimizer(params, margs)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = pm.forward_backward(runner, actions, x if pos.is_first_stage else None,
                             y if pos.is_last_stage else None, margs.microbatches, margs.batch_size)
        opt.step()
        return loss.item() if loss is not None else None
    return step, runner, actions


def torch_pipeline(margs, env, pos):
    """torch.distributed.pipelining on the same blocks, cut at the same boundaries as ours."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleZBVZeroBubble)
    model = build_model(margs).to(env.device)
    p, v = pos.pp_size, pos.virtual
    bounds = pm.partition(len(model), p * v)
    # my chunks' virtual stages, ours: c * p + r in a loop, r and 2p-1-r in zbv's V (torch's "v" style,
    # which ScheduleZBVZeroBubble sets on its stages itself)
    mine = [virtual_stage(c, pos.pp_rank, p, pos.placement) for c in range(v)]
    stages = [PipelineStage(model[slice(*bounds[s])], s, p * v, env.device) for s in mine]
    m = margs.microbatches
    if margs.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=F.cross_entropy)
    elif margs.schedule == "zbv":
        schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=F.cross_entropy)
        for stage in stages:
            no_link_to_self(stage)
    else:
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[margs.schedule](stages[0], m, loss_fn=F.cross_entropy)
    opt = make_optimizer([q for s in stages for q in s.submod.parameters()], margs)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        losses = [] if pos.is_last_stage else None
        inputs = (x,) if pos.is_first_stage else ()
        target = dict(target=y, losses=losses) if pos.is_last_stage else {}
        schedule.step(*inputs, return_outputs=False, **target)   # no output merge: ours does none either
        opt.step()
        return torch.stack(losses).mean().item() if losses else None
    return step


def no_link_to_self(stage):
    """torch 2.11's pipelining opens each stage's links before its first step with a dummy send and
    receive to both neighbours, the V's tip included, whose neighbour is on its own rank: gloo has no
    pair to itself, and the race failed ("Pair is not connected ... <--> [none]"). The dummies carry
    nothing, so leave out those addressed to this rank. (torch 2.14 opens the links by a vote that
    skips same-rank neighbours and never calls this; torch 2.15 has no such method, nothing to mend.)"""
    ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if ops is None:
        return

    def to_others():
        return [op for op in ops() if getattr(op, "group_peer", op.peer) != stage.group_rank]
    stage._get_init_p2p_neighbors_ops = to_others


def one_step(model, opt):
    """step(x, y) -> the loss of single_baseline.train_step, read as a float (as the other engines'
    steps here read theirs): step 0's dropout keys (the benchmarks run without dropout) and no
    gradient norm (nothing clips, nothing logs it)."""
    return lambda x, y: single_baseline.train_step(model, opt, x, y, F.cross_entropy, 0, lambda params: None)[0].item()


def baseline_engine(margs, env):
    """The single-process baseline on rank 0, the other ranks waiting in the barrier."""
    model = build_model(margs).to(env.device)
    step = one_step(model, make_optimizer(model.parameters(), margs))
    return lambda x, y: step(x, y) if env.rank == 0 else None


def bubble_of(runner, actions, pos, margs, step_fn, batches, warmup, repeat):
    """Median measured bubble over `repeat` recorded steps (pipeline_microbatch's own timeline)."""
    measured = []
    for k in range(warmup + repeat):
        x, y = batches[k % len(batches)]
        dist.barrier()
        runner.events, runner.origin = [], time.perf_counter()
        step_fn(x, y)
        trace = gather_timeline(runner, pos, margs)
        runner.events = None
        if k >= warmup:
            measured.append(trace["otherData"]["bubble_measured"])
    return statistics.median(measured), trace["otherData"]["bubble_theory"]


def device_batches(args, env):
    """Four synthetic global batches, on the rank's device (every engine reads the same tensors)."""
    data = SyntheticData(args.seed)
    return [tuple(t.to(env.device) for t in data.batch(s, args.batch_size)) for s in range(4)]


RACED = ("gpipe", "1f1b", "interleaved", "zbv")   # the schedules raced against torch's own (zb: benchmarks/zero_bubble.py)
BUBBLE = ("gpipe", "1f1b", "interleaved")          # the bubble table's (zb's and zbv's: benchmarks/zero_bubble.py)


def pipeline_rank(env, schedule):
    """This rank in the one pipeline of all ranks: 2 chunks for interleaved (in a loop) and zbv (in a V)."""
    return pm.PipelineRank(env.rank, env.world_size, list(range(env.world_size)),
                           2 if schedule in ("interleaved", "zbv") else 1, placement=placement_of(schedule))


def run_pipeline(args, env):
    batches = device_batches(args, env)
    rows = []
    for config in pipeline_grid(args):
        model, m, schedule = split_config(config)
        margs = model_args(args, model, schedule, m)
        pos = pipeline_rank(env, schedule)
        engines = {"ours": ours_pipeline(margs, env, pos)[0], "torch": torch_pipeline(margs, env, pos),
                   "baseline": baseline_engine(margs, env)}
        result = race(engines, batches, args.warmup, args.repeat, env.device)
        rows.append(summarise(config, result))
        if env.rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    bubbles = []
    for m in bubble_counts(args):
        for schedule in BUBBLE:
            margs = model_args(args, "mlp", schedule, m)
            pos = pipeline_rank(env, schedule)
            step, runner, actions = ours_pipeline(margs, env, pos)
            measured, theory = bubble_of(runner, actions, pos, margs, step, batches, 2, 5)
            bubbles.append({"schedule": schedule, "microbatches": m, "measured": measured, "theory": theory})
            if env.rank == 0:
                print(json.dumps(bubbles[-1]), flush=True)
    return {"rows": rows, "bubble": bubbles}


def summarise(config, result):
    """Median seconds per engine and the ratios, with the loss agreement as a sanity check."""
    row = {"config": config, **{f"{n}_s": t for n, (t, _) in result.items()}}
    row["ours_over_torch"] = row["ours_s"] / row["torch_s"]
    row["baseline_over_ours"] = row["baseline_s"] / row["ours_s"]
    row["baseline_over_torch"] = row["baseline_s"] / row["torch_s"]
    row["paired_ours_over_torch"] = race.paired["ours"]   # median of per-step ratios: robust to load drift
    row["max_loss_diff_vs_torch"] = loss_diff(result["ours"][1], result["torch"][1])
    row["max_loss_diff_vs_baseline"] = loss_diff(result["ours"][1], result["baseline"][1])
    return row


# ----------------------------------------------------------------------------- tensor parallel engines


def ours_tp(margs, env):
    model = tp.parallelize(build_model(margs), "mlp", dist.group.WORLD).to(env.device)
    opt = make_optimizer(model.parameters(), margs)
    return one_step(model, opt)


def torch_tp(margs, env):
    """torch.distributed.tensor.parallel with the same column | row pairs as tensor_parallel.parallelize (parallel_mlp_block)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = build_model(margs).to(env.device)
    names = [f"{b}.{i}" for b, block in enumerate(model) for i, mod in enumerate(block) if isinstance(mod, torch.nn.Linear)]
    plan = {name: (RowwiseParallel() if k % 2 else ColwiseParallel()) for k, name in enumerate(names)}
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    model = parallelize_module(model, mesh, plan)
    opt = make_optimizer(model.parameters(), margs)
    return one_step(model, opt)


def run_tp(args, env):
    batches = device_batches(args, env)
    margs = model_args(args, "mlp")
    engines = {"ours": ours_tp(margs, env), "torch": torch_tp(margs, env), "baseline": baseline_engine(margs, env)}
    result = race(engines, batches, args.warmup, args.repeat, env.device)
    row = summarise(f"mlp:tp{env.world_size}", result)
    if env.rank == 0:
        print(json.dumps(row), flush=True)
    return {"rows": [row]}


def main():
    args = parse_args()
    with distributed(args) as env:
        result = (run_pipeline if args.what == "pipeline" else run_tp)(args, env)
        if env.rank == 0:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "world_size": env.world_size, "backend": env.backend,
                           "device": env.device.type, **result}, f, indent=1)
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's destructors (mp.dist.exit_now)


if __name__ == "__main__":
    main()
