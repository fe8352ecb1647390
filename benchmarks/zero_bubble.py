"""zb and 2bw against 1f1b, and the cost of --recompute: measured bubble, step time and the F/B/W
time split of pipeline_microbatch.py itself on 2 stages of a compute-heavy mlp, split as evenly as
it cuts (2 processes on 2 cores: the schedule is measured, not the oversubscription); --stages 4
runs 4 stages of a 16-layer mlp (4 processes on 2 cores: oversubscribed, say so when quoting).

    python benchmarks/zero_bubble.py --out logs/bench/zero_bubble.json     # about 4 minutes on 2 cores
    python benchmarks/zero_bubble.py --paired 80 --out logs/bench/zero_bubble_paired.json   # about a minute
    python benchmarks/zero_bubble.py --paired-zbv 40 --out logs/bench/zero_bubble_zbv.json   # 1f1b, zb, zbv
    python benchmarks/zero_bubble.py --paired-zbv 30 --paired-stages 4    # the same on 4 stages, a core each
    python benchmarks/zero_bubble.py --paired-zbv 40 --even-split   # the same on a model that splits evenly
    python benchmarks/zero_bubble.py --paired-ahead 40 --out logs/bench/zero_bubble_ahead.json   # receives ahead?
    python benchmarks/zero_bubble.py --paired-fused 40    # 1f1b, gpipe against their W in B and unsplit (autograd W)

Each configuration runs `--rounds` times, the configurations of one microbatch count in turn
(1f1b, zb, 1f1b --recompute, ...), so a drift of the machine's speed hits all alike; a run's step
time is the median of its steps after the first, its bubble is that of its last step's timeline
(1 - compute time / (stages x span)). Ratios are taken round by round, then their median.

--paired: 1f1b, zb and zb-autograd-w (zb with every W through autograd, as before W added into
A.grad directly) built side by side in one pair of processes on the mlp 8x768, --balance 2,6,
batch 256, m = 8, and stepped in turn, the order rotating every round, each step between two
barriers and on the timeline; the load average is read around every round. It reports the median
of the round-by-round ratios to 1f1b, each action's median duration per stage, the one-way time
of one message (half a ping-pong), and the arithmetic (simulate): the span each schedule's compute
order takes with those durations.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pipeline_microbatch as pm  # noqa: E402
from mp.data import SyntheticData  # noqa: E402
from mp.dist import distributed  # noqa: E402
from mp.flags import OneLineParser, base_parser  # noqa: E402
from mp.models import build_model  # noqa: E402
from mp.pp.flags import add_pipeline_flags  # noqa: E402
from mp.optim import make_optimizer  # noqa: E402
from mp.pp.schedules import compute_order, placement_of, schedule_actions, stage_owner, virtual_stage  # noqa: E402
from mp.pp.timeline import gather_timeline  # noqa: E402
from mp.pp.zero_bubble import WeightGradStash, split_weight_grads  # noqa: E402

# --balance 3,5: the first Linear (3072 x 1024) has 3 times the multiply-adds of each other one
MLP = ["--model", "mlp", "--layers", "8", "--hidden", "1024", "--balance", "3,5", "--batch-size", "192",
       "--data", "synthetic", "--eval-every", "0", "--threads", "1"]
MLP4 = ["--model", "mlp", "--layers", "16", "--hidden", "1024", "--balance", "3,5,4,4", "--batch-size", "192",
        "--data", "synthetic", "--eval-every", "0", "--threads", "1"]
CONFIGS = {"1f1b": ["--schedule", "1f1b"], "zb": ["--schedule", "zb"], "2bw": ["--schedule", "2bw"],
           "1f1b --recompute": ["--schedule", "1f1b", "--recompute"]}


def run_once(args, folder, stages=2):
    log, trace = os.path.join(folder, "log.jsonl"), os.path.join(folder, "trace.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}", "--",
           os.path.join(ROOT, "pipeline_microbatch.py"), *args, "--log-file", log, "--timeline", trace]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"error: pipeline_microbatch.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        times = [json.loads(line)["step_time_s"] for line in f if '"train"' in line]
    with open(trace) as f:
        trace = json.load(f)
    other = trace["otherData"]
    return statistics.median(times[1:]), other["bubble_measured"], other["bubble_theory"], split_ms(trace)


def split_ms(trace, kinds=None):
    """{stage: {F, B, W, R: milliseconds per step}}: where each stage's compute goes (W: zb's
    weight gradients, R: --recompute's forwards), from the recorded step(s)."""
    steps = trace["otherData"].get("steps") or 1     # a step the benchmark records itself has no "step" mark
    kinds = kinds or {"forward": "F", "backward": "B", "weight": "W", "recompute": "R"}
    out = {}
    for e in trace["traceEvents"]:
        if e.get("cat") in kinds:
            stage = out.setdefault(str(e["pid"]), {})
            stage[kinds[e["cat"]]] = stage.get(kinds[e["cat"]], 0) + e["dur"] / 1000 / steps
    return {stage: {k: round(v, 2) for k, v in kinds_ms.items()} for stage, kinds_ms in sorted(out.items())}


def measure(microbatches, rounds, steps, stages=2, configs=CONFIGS):
    rows = []
    model = MLP if stages == 2 else MLP4
    with tempfile.TemporaryDirectory() as folder:
        for m in microbatches:
            runs, loads = {name: [] for name in configs}, []
            for _ in range(rounds):
                loads.append(loadavg())
                for name, flags in configs.items():
                    runs[name].append(run_once(model + flags + ["--microbatches", str(m), "--steps", str(steps)],
                                               folder, stages))
                loads.append(loadavg())
            for name, results in runs.items():
                ratio = [r[0] / b[0] for r, b in zip(results, runs["1f1b"])]
                rows.append({"config": name, "stages": stages, "microbatches": m,
                             "step_s": statistics.median(r[0] for r in results),
                             "split_ms": results[len(results) // 2][3],
                             "bubble_measured": statistics.median(r[1] for r in results),
                             "bubble_theory": results[0][2], "over_1f1b": statistics.median(ratio),
                             "load": [min(loads), max(loads)]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------- paired steps in one pair of processes

PAIRED = ["--model", "mlp", "--layers", "8", "--hidden", "768", "--balance", "2,6", "--batch-size", "256",
          "--microbatches", "8", "--data", "synthetic", "--eval-every", "0", "--threads", "1"]
ENGINES = ("1f1b", "zb", "zb-autograd-w")   # zb-autograd-w: zb with every W through autograd (a no-op hook)
# --paired-zbv: 1f1b, zb and zbv on 14 Linear layers, whose first (3072 x 768) counts 2.7 others' flops (4 times
# their multiply-adds, no input gradient). Each schedule runs the split --balance auto gives it: 6,8 for 1f1b and
# zb (7.7 and 7.0 layers' worth a rank), 2,3,4,5 for zbv (mp.pp.balance.v_split, each rank's two chunks summed:
# 7.7 and 7.0; the chunk-by-chunk 2,4,4,4 would give rank 1 blocks 2-9, 8 layers' worth, against rank 0's 6.7).
# 1f1b-in-b: 1F1B with each W inside its B, the textbook 1F1B (our 1F1B runs W after B's send, zero bubble's idea)
ZBV_ENGINES = ("1f1b", "zb", "zbv", "1f1b-in-b")
ZBV_EXTRA, ZBV_BALANCE = ["--layers", "14", "--balance", "auto"], "auto"
# --paired-ahead: the same, each schedule also with the executor's receives posted only in their own exchange
# ("-late": Messenger(ahead=0), as before receives went out ahead on gloo), to measure that change in one run
AHEAD_ENGINES = ("1f1b", "1f1b-late", "zbv", "zbv-late")
# --paired-fused: 1f1b and gpipe, each also with its Ws inside their B ("-in-b": as before the next exchange ran them,
# once B's gradient was sent) and with every weight gradient through autograd ("-unsplit": as before each
# B added its weights' gradients in place, pipeline_microbatch.StageRunner's split "B"), on --paired-zbv's model
FUSED_ENGINES = ("1f1b", "1f1b-in-b", "1f1b-unsplit", "gpipe", "gpipe-in-b", "gpipe-unsplit")


def paired_worker(argv):
    """Under torchrun: the engines built side by side in the same processes, stepped in turn (the
    order rotating every round, each step between two barriers), each step recorded on the
    timeline. Rank 0 prints one JSON object: per round, each engine's seconds, bubble and per-stage
    F/B/W/wait milliseconds, the load average, and the one-way time of one message."""
    rounds, warmup, names, extra = int(argv[0]), int(argv[1]), tuple(argv[2].split(",")), argv[3:]
    margs = {name: pm.parse_args(PAIRED + extra + ["--schedule", name.split("-")[0]] +
                                 (["--balance", ZBV_BALANCE] if name == "zbv" else [])) for name in names}
    with distributed(margs["1f1b"]) as env:
        positions = {name: pm.PipelineRank(env.rank, env.world_size, list(range(env.world_size)),
                                           margs[name].virtual_stages, placement=placement_of(margs[name].schedule))
                     for name in names}
        pos = positions["1f1b"]
        engines = {name: engine(margs[name], env, positions[name], autograd_w=name == "zb-autograd-w",
                                late=name.endswith("-late"), unsplit=name.endswith("-unsplit"),
                                in_b=name.endswith("-in-b")) for name in names}
        data = SyntheticData(margs["1f1b"].seed)
        batches = [data.batch(s, margs["1f1b"].batch_size) for s in range(4)]
        first = margs["1f1b"]
        message_ms = one_way_ms(pos, first.batch_size // first.microbatches, first.hidden)
        rows = []
        for k in range(warmup + rounds):
            load = loadavg()
            order = names[k % len(names):] + names[:k % len(names)]
            row = {name: timed_step(engines[name], batches[k % len(batches)], positions[name], margs[name])
                   for name in order}
            if k >= warmup:
                rows.append({"load": [load, loadavg()], **row})
        if env.rank == 0:
            print("PAIRED " + json.dumps({"args": PAIRED + extra, "engines": names, "microbatches": first.microbatches,
                                          "message_ms": message_ms, "rounds": rows}), flush=True)


def engine(margs, env, pos, autograd_w=False, late=False, unsplit=False, in_b=False):
    if unsplit:                 # no layer split: a stash with nothing in it, and autograd takes every gradient in B
        pm.split_weight_grads = lambda chunk, **_: WeightGradStash()
    try:
        model, runner = pm.setup_stage(margs, env, pos, messenger=partial(pm.Messenger, ahead=0) if late else None)
    finally:
        pm.split_weight_grads = split_weight_grads
    if autograd_w:              # a weight with a gradient hook takes its W through autograd (zero_bubble.py)
        for chunk in runner.chunks:
            for p in chunk.parameters():
                p.register_post_accumulate_grad_hook(lambda p: None)
    opt = make_optimizer([p for chunk in runner.chunks for p in chunk.parameters()], margs)
    if in_b:                    # each W inside its B, before B's gradient is sent (as before the exchange ran it)
        backward = runner.backward

        def backward_then_w(mb, chunk, *rest):
            start = backward(mb, chunk, *rest)
            runner.stashes[chunk].weight_grads(mb)
            return start
        runner.backward = backward_then_w
    if late:                    # as before this change: zbv's sends where rendezvous places them, waited as 1F1B's
        runner.messenger.sends_at_once = False
    actions = schedule_actions(margs.schedule, pos, margs.microbatches, sends_at_once=runner.messenger.sends_at_once)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = pm.forward_backward(runner, actions, x if pos.is_first_stage else None, y if pos.is_last_stage else None,
                             margs.microbatches, margs.batch_size)
        opt.step()
        return None if loss is None else loss.item()
    return step, runner


def timed_step(engine, batch, pos, margs):
    """One step between two barriers, on the timeline; its seconds, loss, bubble and split."""
    step, runner = engine
    dist.barrier()
    runner.events, runner.origin = [], time.perf_counter()
    cpu = time.thread_time()
    loss = step(*batch)
    cpu = time.thread_time() - cpu       # this rank's main thread: its compute, the executor, the optimizer
    dist.barrier()
    seconds = time.perf_counter() - runner.origin
    trace = gather_timeline(runner, pos, margs)
    runner.events = None
    losses = [None] * pos.pp_size
    dist.all_gather_object(losses, (loss, cpu))
    split = split_ms(trace, kinds={"forward": "F", "backward": "B", "weight": "W", "wait": "wait"})
    loss = next(x for x, _ in losses if x is not None)   # the last stage's (zbv: rank 0's, at the V's end)
    return {"s": seconds, "loss": loss, "bubble": trace["otherData"]["bubble_measured"], "split_ms": split,
            "per_mb_ms": per_microbatch_ms(trace), "busy": [c / seconds for _, c in losses]}


def per_microbatch_ms(trace):
    """{stage: {kind: median milliseconds of one action}}: the durations the arithmetic takes."""
    durations = {}
    for e in trace["traceEvents"]:
        if e.get("cat") in ("forward", "backward", "weight"):
            kind = e["name"][0] + ("b" if e["args"]["chunk"] == 1 else "")   # zbv's chunk b: Fb, Bb, Wb
            durations.setdefault(str(e["pid"]), {}).setdefault(kind, []).append(e["dur"] / 1000)
    return {stage: {k: statistics.median(v) for k, v in kinds.items()} for stage, kinds in sorted(durations.items())}


def one_way_ms(pos, mb_size, hidden, repeat=50):
    """Half a ping-pong of one activation (mb_size x hidden floats) between stages 0 and 1: a message's
    cost when its receiver is already waiting."""
    t, peer = torch.zeros(mb_size, hidden), 1 - pos.pp_rank
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        if pos.pp_rank == 0:
            dist.send(t, peer), dist.recv(t, peer)
        elif pos.pp_rank == 1:                # more stages: ranks 0 and 1 stand for every neighbouring pair
            dist.recv(t, peer), dist.send(t, peer)
        times.append((time.perf_counter() - start) / 2 * 1e3)
    return statistics.median(times)


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def simulate(schedule, ms, message_ms, p, m):
    """The arithmetic: the span of one step of `schedule` (its compute order from mp.pp.schedules; a
    fused W, timed apart, right after its B) when every action lasts the measured median ms[stage][F,
    B or W] (zbv's chunk b: Fb, Bb, Wb) and every message between ranks message_ms; an action starts
    once its rank is free and its input is in. Returns (span ms, bubble)."""
    placement, v = placement_of(schedule), 2 if schedule == "zbv" else 1
    orders = [compute_order(schedule, p, m, r, v) for r in range(p)]
    if schedule not in ("zb", "zbv") and "W" in ms["0"]:   # a fused W: right after its B, once B's gradient is sent
        orders = [[a for action in order for a in ([action, ("W", *action[1:])] if action[0] == "B" else [action])]
                  for order in orders]
    done, free, at = {}, [0.0] * p, [0] * p

    def cost(r, kind, chunk):
        return ms[str(r)][kind + ("b" if chunk == 1 else "")]
    while any(at[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if at[r] == len(orders[r]):
                continue
            kind, mb, chunk = orders[r][at[r]]
            vs = virtual_stage(chunk, r, p, placement)
            need = {"F": ("F", mb, vs - 1) if vs > 0 else None, "W": ("B", mb, vs),
                    "B": ("B", mb, vs + 1) if vs < p * v - 1 else ("F", mb, vs)}[kind]
            if need is None or need in done:
                far = need is not None and stage_owner(need[2], p, placement)[0] != r
                ready = 0.0 if need is None else done[need] + (message_ms if far else 0.0)
                free[r] = done[(kind, mb, vs)] = max(free[r], ready) + cost(r, kind, chunk)
                at[r], moved = at[r] + 1, True
        assert moved, "the compute orders wait on each other"
    work = sum(cost(r, kind, chunk) for r in range(p) for kind, _, chunk in orders[r])
    return max(free), 1 - work / (p * max(free))


def summarise_paired(result):
    """Per engine: the median of the round-by-round ratios to 1f1b, the median step, bubble, split and
    action durations; the arithmetic's span of each schedule from those durations; the loads seen."""
    rounds = result["rounds"]
    out = {"message_ms": round(result["message_ms"], 3), "rounds": len(rounds),
           "load": [min(r["load"][0] for r in rounds), max(r["load"][1] for r in rounds)]}
    names = result.get("engines", ENGINES)
    for name in names:
        runs = [r[name] for r in rounds]
        ms = {st: {k: statistics.median(r["per_mb_ms"][st][k] for r in runs) for k in runs[0]["per_mb_ms"][st]}
              for st in runs[0]["per_mb_ms"]}
        span, bubble = simulate(name.split("-")[0], ms, result["message_ms"], len(ms), result["microbatches"])
        out[name] = {"over_1f1b": statistics.median(r[name]["s"] / r["1f1b"]["s"] for r in rounds),
                     "ratios": [round(r[name]["s"] / r["1f1b"]["s"], 3) for r in rounds],
                     "step_ms": statistics.median(r["s"] for r in runs) * 1e3,
                     "bubble": statistics.median(r["bubble"] for r in runs),
                     # each rank's main-thread CPU over the step's wall time: 1 - busy is what it really idled
                     "busy": [round(statistics.median(r["busy"][k] for r in runs), 3)
                              for k in range(len(runs[0]["busy"]))],
                     "split_ms": runs[len(runs) // 2]["split_ms"],
                     "per_mb_ms": {st: {k: round(v, 2) for k, v in d.items()} for st, d in ms.items()},
                     "sim_span_ms": round(span, 1), "sim_bubble": round(bubble, 3),
                     "loss_diff": max(abs(r[name]["loss"] - r["1f1b"]["loss"]) for r in rounds)}
    for name in names:
        out[name]["sim_over_1f1b"] = round(out[name]["sim_span_ms"] / out["1f1b"]["sim_span_ms"], 3)
        if "1f1b-late" in names:       # --paired-ahead: the schedules as they ran before receives went ahead
            out[name]["over_1f1b_late"] = statistics.median(r[name]["s"] / r["1f1b-late"]["s"] for r in rounds)
        if "1f1b-in-b" in names:       # --paired-zbv, --paired-fused: against the textbook 1F1B too
            out[name]["over_1f1b_in_b"] = statistics.median(r[name]["s"] / r["1f1b-in-b"]["s"] for r in rounds)
        for other in ("in-b", "unsplit"):   # --paired-fused: each schedule against its W in B, its autograd W
            if f"{name}-{other}" in names:
                out[name][f"over_{other.replace('-', '_')}"] = statistics.median(
                    r[name]["s"] / r[f"{name}-{other}"]["s"] for r in rounds)
    if "zb" not in names:
        return out
    # the schedule alone: zb's order with a split that costs nothing (B + W = 1F1B's backward)
    fused, zb = out["1f1b"]["per_mb_ms"], out["zb"]["per_mb_ms"]
    free = {st: {"F": fused[st]["F"], "B": zb[st]["B"], "W": fused[st]["B"] + fused[st].get("W", 0) - zb[st]["B"]}
            for st in zb}
    span, _ = simulate("zb", free, result["message_ms"], len(free), result["microbatches"])
    out["zb"]["sim_free_split_over_1f1b"] = round(span / out["1f1b"]["sim_span_ms"], 3)
    return out


def stages_args(p, even=False):
    """--paired-zbv's model on p stages: 7 layers a rank, m = max(8, 2p), 32 samples a microbatch (p = 2:
    the 14-layer model, m = 8, batch 256). even (--even-split): 6 layers of 1024 a rank instead, a model
    whose blocks split evenly both ways (EVEN_SPLIT)."""
    m = max(8, 2 * p)
    size = ["--layers", str(6 * p), "--hidden", "1024"] if even else ["--layers", str(7 * p)]
    return size + ["--microbatches", str(m), "--batch-size", str(32 * m)]


# --even-split. At hidden 768 the first block (3072 inputs) counts 2.67 hidden blocks, so no split of the
# 7p-layer mlp is even: on 2 stages 1F1B's stage 0 and zbv's rank 0 both count 7.67 against 7, and the
# lighter rank idles for the difference whatever the schedule. At hidden 1024 it counts 2, and 6p layers
# split into p stages (1F1B: 5,7 on 2 stages) or p ranks of a V (zbv: 2,3,3,4) of 6 counted blocks each.
# (Measured, docs/results.md: zbv against 1F1B moved little with it, 0.95-0.97 against 0.97-0.99.)
EVEN_SPLIT = "the mlp of 6 layers of 1024 a rank, whose --balance auto splits are even (6 counted blocks a rank)"


def run_paired(rounds, warmup, extra, engines=ENGINES, stages=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}", "--",
           os.path.abspath(__file__), "--paired-worker", str(rounds), str(warmup), ",".join(engines), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PAIRED ")]
    if proc.returncode or not lines:
        sys.exit(f"error: the paired run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return summarise_paired(json.loads(lines[0][len("PAIRED "):]))


# ----------------------------------------------------------------------------- the pieces, in one process

def pieces(repeat=60):
    """Single-process medians (ms) of one microbatch's actions on each stage of the --paired model:
    F; 1F1B's backward (autograd, fused); zb's B; its W added directly; its W through autograd (a
    no-op hook on every weight); and the products of one 768 x 768 layer. Interleaved round by round."""
    torch.set_num_threads(1)
    margs = add_pipeline_flags(base_parser("")).parse_args(PAIRED)   # unchecked: one process stands for 2 stages
    model, m = build_model(margs), margs.microbatches
    mb = margs.batch_size // m
    x, labels = SyntheticData(margs.seed).batch(0, mb)
    cases, out = {}, {}
    for stage, (start, end) in enumerate(pm.partition(len(model), 2, margs.balance)):
        plain = torch.nn.Sequential(*model[start:end])
        split, hooked = copy.deepcopy(plain), copy.deepcopy(plain)
        stashes = {"W": split_weight_grads(split), "W autograd": split_weight_grads(hooked)}
        for p in hooked.parameters():
            p.register_post_accumulate_grad_hook(lambda p: None)
        inp = x if stage == 0 else torch.randn(mb, margs.hidden).requires_grad_()
        head = (lambda y: F.cross_entropy(y, labels) / m) if stage == 1 else (lambda y: (y * y).sum())
        cases[stage] = (plain, split, hooked, stashes, inp, head)
        x = plain(x).detach()
    times = {}
    for k in range(repeat):
        for stage, case in cases.items():
            for name, ms in time_stage(*case, k).items():
                times.setdefault(str(stage), {}).setdefault(name, []).append(ms)
    out = {stage: {name: round(statistics.median(v[5:]), 3) for name, v in d.items()} for stage, d in times.items()}
    out["layer"] = time_layer(mb, margs.hidden, repeat)
    return out


def time_stage(plain, split, hooked, stashes, inp, head, k):
    """One round of the pieces of one stage, microbatch number k in the stashes."""
    def clocked(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    result, kept = {}, {}
    result["F"] = clocked(lambda: kept.update(plain=head(plain(inp))))
    result["1F1B backward"] = clocked(lambda: kept.pop("plain").backward())
    for name, model in (("W", split), ("W autograd", hooked)):
        loss = head(model(inp))
        with stashes[name].backward_of(k):
            b = clocked(lambda: loss.backward())
        result.setdefault("B", b)
        result[name] = clocked(lambda: stashes[name].weight_grads(k))
    return result


def time_layer(mb, hidden, repeat):
    """One layer's products (ms): dx = dy A, dA = dy^T x into a new tensor, that plus the add into
    A.grad (autograd's accumulation), and one addmm_ into A.grad (the direct W)."""
    w, grad, x, dy = (torch.randn(*s) for s in ((hidden, hidden), (hidden, hidden), (mb, hidden), (mb, hidden)))
    ops = {"dx": lambda: dy @ w, "dA": lambda: dy.t() @ x, "dA then add": lambda: grad.add_(dy.t() @ x),
           "addmm_": lambda: grad.addmm_(dy.t(), x)}
    times = {name: [] for name in ops}
    for _ in range(repeat * 4):
        for name, op in ops.items():
            start = time.perf_counter()
            op()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: round(statistics.median(v), 3) for name, v in times.items()}


def main():
    if sys.argv[1:2] == ["--paired-worker"]:
        return paired_worker(sys.argv[2:])
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "logs", "bench", "zero_bubble.json"))
    p.add_argument("--microbatches", default="4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stages", default="2,4",
                   help="2 and/or 4; 4: 1f1b and 2bw only, on a 16-layer mlp (4 processes on this machine's cores), "
                        "at the microbatch counts >= 4")
    p.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                   help="instead: 1f1b, zb and zb with W through autograd stepped in turn in one pair of processes "
                        "(mlp 8x768, --balance 2,6, batch 256, m 8), ROUNDS rounds after 3 warm-up rounds")
    p.add_argument("--paired-zbv", type=int, default=0, metavar="ROUNDS",
                   help="instead: --paired's run with 1f1b, zb and zbv on --layers 14, each on the split "
                        "--balance auto gives it (1f1b and zb 6,8; zbv 2,3,4,5), and 1f1b-in-b (the textbook "
                        "1F1B: each W inside its B)")
    p.add_argument("--paired-ahead", type=int, default=0, metavar="ROUNDS",
                   help="instead: --paired-zbv's run with 1f1b and zbv, each also with receives posted only in "
                        "their own exchange (1f1b-late, zbv-late: the executor before gloo posted them ahead)")
    p.add_argument("--paired-fused", type=int, default=0, metavar="ROUNDS",
                   help="instead: --paired-zbv's run with 1f1b and gpipe, each also with its Ws inside "
                        "their B (1f1b-in-b, gpipe-in-b: before the next exchange ran them) and with every weight "
                        "gradient through autograd (1f1b-unsplit, gpipe-unsplit: before each B added them in place)")
    p.add_argument("--paired-stages", type=int, default=2, metavar="P",
                   help="with --paired-zbv, --paired-ahead or --paired-fused: P stages, one process each (one "
                        "core each wanted: a lent 16-core machine), on 7 x P layers, m = max(8, 2P), 32 samples "
                        "a microbatch; 2 is the model above")
    p.add_argument("--even-split", action="store_true",
                   help=f"with --paired-zbv, --paired-ahead or --paired-fused: {EVEN_SPLIT}, instead of 7 layers "
                        "of 768 a rank (whose first stage counts 7.67 blocks against 7 on 2 stages)")
    p.add_argument("--pieces", action="store_true",
                   help="instead: one process, each stage's F, 1F1B backward, B and W of one microbatch, timed alone")
    args = p.parse_args()
    if args.pieces:
        print(json.dumps({"load": loadavg(), "pieces": pieces(), "load_after": loadavg()}, indent=1))
        return
    modes = {"--paired": args.paired, "--paired-zbv": args.paired_zbv, "--paired-ahead": args.paired_ahead,
             "--paired-fused": args.paired_fused}
    for flag, n in modes.items():
        if n < 0:
            p.error(f"{flag} {n}: give the rounds to run, 1 or more (0: not this mode)")
    rounds = args.paired or args.paired_zbv or args.paired_ahead or args.paired_fused
    if args.paired_stages != 2 and not rounds:
        p.error(f"--paired-stages {args.paired_stages} goes with --paired-zbv, --paired-ahead or --paired-fused: "
                "add one of them, or drop --paired-stages")
    if args.even_split and not (rounds and not args.paired):
        p.error("--even-split goes with --paired-zbv, --paired-ahead or --paired-fused: add one of them (not "
                "--paired), or drop --even-split")
    if rounds:
        stages = args.paired_stages
        if stages < 2 or (args.paired and stages != 2):
            p.error(f"--paired-stages {stages}: give 2 or more, with --paired-zbv, --paired-ahead or --paired-fused "
                    "(--paired runs 2 stages: drop --paired-stages there)")
        extra = [] if args.paired else ZBV_EXTRA + stages_args(stages, args.even_split)
        engines = ENGINES if args.paired else ZBV_ENGINES if args.paired_zbv else \
            AHEAD_ENGINES if args.paired_ahead else FUSED_ENGINES
        summary = run_paired(rounds, 3, extra, engines, stages)
        print(json.dumps(summary, indent=1))
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "model": PAIRED + extra, "cpus": os.cpu_count(), "paired": summary},
                      f, indent=1)
        return
    rows = []
    for stages in (int(s) for s in args.stages.split(",")):
        configs = CONFIGS if stages == 2 else {k: CONFIGS[k] for k in ("1f1b", "2bw")}
        ms = [m for m in (int(m) for m in args.microbatches.split(",")) if m >= stages]   # 2bw: m >= p
        rows += measure(ms, args.rounds, args.steps, stages, configs)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "model": MLP, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
