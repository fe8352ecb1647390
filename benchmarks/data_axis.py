"""The data axis against torch's own engines: our --zero 0-3 beside DDP, FSDP2 and ZeroRedundancyOptimizer.

    python benchmarks/data_axis.py                        # mlp 8 x 1024, D = 4, batch 64, AdamW, 3 paired rounds
    python benchmarks/data_axis.py --hidden 64 --steps 4 --rounds 1   # a quick look
    python benchmarks/data_axis.py --model vit --layers 6 --hidden 256 --steps 10 --rounds 3   # the vit rows
    python benchmarks/data_axis.py --no-floor --only 0,ddp ...   # no floor runs: the harness, not memory figures

$PYTHON, where set, is the python its torchruns start (as the launchers read it; the tests set their zygote's).

Ours is pipeline_dp_joint.py --dp D (one stage, one microbatch); torch's run in this file's worker (the same
torchrun, the same model from mp.models.build_model and --seed, the same global batches, AdamW from
mp.optim.make_optimizer with the same settings, the replica's slice of every batch):

    ddp        DistributedDataParallel, its defaults (25 MB buckets, the first 1 MB; .grad beside the buckets)
    ddp-like   the same with our --zero 0 buckets' size (mp.buckets.kept_bytes) as its cap: with the plans alike,
               its pair shows the engines alone; ddp's pair adds what our plan costs. Not run by default:
               --only 0,ddp,ddp-like
    zero1      DDP + ZeroRedundancyOptimizer(AdamW): the state of 1/D of the parameters, a broadcast after
    fsdp2      fully_shard on every Linear and on the root, reshard_after_forward=False (ZeRO-2's memory)
    fsdp2-rs   the same with reshard_after_forward=True (ZeRO-3: weights gathered again for the backward)

The pairs: --zero 0 / ddp (and ddp-like), --zero 1 / zero1, --zero 2 / fsdp2, --zero 3 (each --zero3-gather) / fsdp2
and fsdp2-rs. A round runs every engine of --only, ours and torch's in turn (A, B, A, B...; every other round the
other way, B, A, B, A...), three torchruns each: one timed, one for memory, and one with a tiny model (--hidden 8:
the interpreter, torch, gloo, the data) for its floor. Memory is the peak RSS of the steps above the floor's,
summed over the D ranks, with glibc's mmap threshold pinned (docs/memory.md: a freed tensor's pages go back at
once, so the resident set follows what is held). The steps' peak: the kernel's high-water mark is reset when
set-up ends (reset_peak), in the worker and in ours (--ours runs pipeline_dp_joint.py's main with the loop's
start_memory_count doing it), since a tiny model's peak over the whole process is set-up's, whose transients
differ by engine (on the vit the worker's DDP set-up peaked 5 MB above ours, while their steps held the same).
Step time: the median step of rank 0 (step 0 left out), zero_grad to the update's end, of the timed run, with
glibc's allocator as a user has it: pinned, every tensor over 128 KB that is freed gives its pages back and the
next one faults them in again, which is no engine's cost but the measuring's (the vit's steps took half as long
again, every engine's). The timed runs of a pair's two engines run at once, in lockstep (benchmarks/lockstep.py):
before each step a rank waits for its engine's turn, so their steps alternate a second apart and what else the
machine does meanwhile falls on both alike (--apart: one after the other, as before 2026-11-29; a minute apart, the
vit's --zero 0 / ddp ratio ranged over 0.94-1.09 in 8 rounds, in lockstep over 1.01-1.03 in 6). The CPU time is
then that of the engine's turns, and its span theirs. Printed per pair: the medians over rounds of each side and of
the per-round ratios ours/torch (with several rounds, each ratio's range over them too: the rounds' spread, against
which to read a median a little over 1), what a replica holds between steps and sends per step, and the largest
loss difference over the steps (the engines sum the replicas' gradients in other orders: float32 rounding, not a
bug); then, from the timed runs, each side's CPU time (every thread of every rank: steps_usage), the main threads'
part of it (the model's; the rest is the collectives' threads), minor page faults a step and the share of the
cores' time over the steps that no rank used, which say whether a step-time ratio is work done, and whose, or cores
left idle. The last line names the cores and whether the kernel's autogroup was on (Linux), under which our ranks'
step times swing.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # the repository root

from lockstep import ENV as LOCKSTEP_ENV, Lockstep, Turn, engine_span, wait_all  # noqa: E402  (beside this file)
from mp.buckets import kept_bytes  # noqa: E402
from mp.cli import baseline_args  # noqa: E402
from mp.data import dp_slice, load_data  # noqa: E402
from mp.flags import Parser  # noqa: E402
from mp.models import build_model  # noqa: E402
from mp.optim import make_optimizer  # noqa: E402
import pipeline_dp_joint  # noqa: E402
from pipeline_dp_joint import parse_args  # noqa: E402
OURS = {"0": ["--zero", "0"], "1": ["--zero", "1"], "2": ["--zero", "2"],
        "3-step": ["--zero", "3", "--zero3-gather", "step"], "3-microbatch": ["--zero", "3", "--zero3-gather", "microbatch"]}
LIKE = "ddp-like"   # DDP with our buckets' cap
PAIRS = [("0", "ddp"), ("0", LIKE), ("1", "zero1"), ("2", "fsdp2"), ("3-step", "fsdp2"),
         ("3-microbatch", "fsdp2-rs")]
ORDER = ["0", "ddp", LIKE, "1", "zero1", "2", "fsdp2", "3-step", "3-microbatch", "fsdp2-rs"]   # A, B, A, B...
DEFAULT = [name for name in ORDER if name != LIKE]   # the pairs the issue names; LIKE on request


# ----------------------------------------------------------------------------- torch's engines (the worker)


def wrap(engine, model, args, world):
    """(the model as the engine trains it, its optimizer)."""
    if engine == LIKE:               # the cap only: its first bucket stays 1 MB, as DDP makes it
        cap_mb = kept_bytes(list(model.parameters())) / 2**20
        return DDP(model, bucket_cap_mb=cap_mb), make_optimizer(model.parameters(), args)
    if engine in ("ddp", "zero1"):
        model = DDP(model)
        if engine == "zero1":
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                          betas=(args.beta1, args.beta2), eps=args.adam_eps,
                                          weight_decay=args.weight_decay, fused=False)
            return model, opt
        return model, make_optimizer(model.parameters(), args)
    mesh = init_device_mesh("cpu", (world,))
    reshard = engine == "fsdp2-rs"
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, make_optimizer(model.parameters(), args)


def reset_peak():
    """The kernel's high-water mark of this process's resident set, reset to what it holds now (Linux:
    /proc/self/clear_refs, 5), so that the peak read afterwards is the steps', not set-up's. Also the
    start of the steps' CPU time, page faults and span (steps_usage)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    SETUP_OVER[:] = [resource.getrusage(resource.RUSAGE_SELF), time.monotonic(), time.thread_time()]


TURN = Turn.from_env()   # this rank's turns where the driver runs the engines in lockstep (benchmarks/lockstep.py)
SETUP_OVER = []   # this process's rusage, clock and main thread's CPU clock when set-up ended: a global, as in
                  # ours the loop calls reset_peak (in the main thread, as steps_usage)


def steps_usage(log_file):
    """Write, beside the log, what this rank's process used since set-up ended: CPU seconds (every thread:
    gloo's and autograd's too, user and system), those of the main thread alone (the model's forward, backward
    and update, and the Python around them; the rest is the collectives' threads), minor page faults (a page
    of memory touched for the first time since the kernel handed it out), and when that began and ended (the
    machine's monotonic clock, one for every process). launch() sums the ranks' files."""
    # the main thread's span inside the process's (read after it at set-up's end, before it here): never more
    main_now = time.thread_time()
    now, (then, start, main_then) = resource.getrusage(resource.RUSAGE_SELF), SETUP_OVER
    used = {"cpu_s": now.ru_utime + now.ru_stime - then.ru_utime - then.ru_stime, "main_cpu_s": main_now - main_then,
            "minor_faults": now.ru_minflt - then.ru_minflt, "start": start, "end": time.monotonic()}
    if TURN:      # in lockstep: the CPU time of its turns alone (the steps and what the loop does between them)
        used.update(cpu_s=TURN.cpu_s, main_cpu_s=TURN.main_cpu_s, turns=TURN.spans)
    with open(f"{log_file}.usage.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(used, f)


def peak_mb():
    """This process's peak resident set since reset_peak (VmHWM), in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def local_mb(tensors):
    """MB of this rank's part of the tensors (a DTensor's local shard)."""
    out = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        out += t.numel() * t.element_size()
    return out / 2**20


def worker(engine, argv):
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data(args)
    model, opt = wrap(engine, build_model(args), args, world)
    reset_peak()                                  # set-up is over: the peak of the steps from here
    losses, times = [], []
    for step in range(args.steps):
        if TURN:
            TURN.next()                           # (in lockstep) this engine's turn
        start = time.perf_counter()
        x, y = data.batch(step, args.batch_size)
        x, y = dp_slice(x, rank, world), dp_slice(y, rank, world)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    if TURN:
        TURN.finish()
    steps_usage(args.log_file)
    params = list(model.parameters())
    inner = getattr(opt, "optim", opt)            # ZeroRedundancyOptimizer's local AdamW
    held = [local_mb(params), local_mb([p.grad for p in params if p.grad is not None]),
            local_mb([v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()])]
    losses = torch.stack(losses)
    dist.all_reduce(losses)                       # the replicas' mean, as our log's
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_mb())
    if rank == 0:
        with open(args.log_file, "w") as f:
            json.dump({"losses": (losses / world).tolist(), "median_step_time_s": statistics.median(times[1:]),
                       "peak_memory_mb": {str(r): m for r, m in enumerate(peaks)},
                       "held_mb": held}, f)
    dist.destroy_process_group()


def ours(argv):
    """pipeline_dp_joint.py, its peak measured as the worker's: the loop says when set-up is over
    (mp.loop.start_memory_count, a no-op on the CPU, where the process's peak includes set-up) and the
    summary's peak_memory_mb, taken after the last step (and its log line's sums), is then the steps'
    (peak_mb), its CPU time, faults and span read there too (steps_usage); nothing else of the program is touched."""
    import mp.log
    import mp.loop
    log_file = argv[argv.index("--log-file") + 1]     # launch() always gives one

    def steps_peak_mb(device, kind="allocated"):
        if TURN:
            TURN.finish()
        steps_usage(log_file)
        return peak_mb()
    mp.loop.start_memory_count = lambda device: reset_peak()
    mp.log.peak_memory_mb = steps_peak_mb
    if TURN:                                          # in lockstep: each step's clock starts on its turn
        step_start = mp.loop.StepScalars.start

        def start_on_turn(self):
            TURN.next()
            return step_start(self)
        mp.loop.StepScalars.start = start_on_turn
    pipeline_dp_joint.main(argv)


# ----------------------------------------------------------------------------- the driver


def launch(name, flags, log, pinned=True):
    """One run of engine `name` (ours: pipeline_dp_joint.py) on D ranks: {losses, median_step_time_s,
    peak_memory_mb, held_mb, sent_mb, cpu_s, main_cpu_s, minor_faults, wall_s}. pinned: glibc's mmap threshold
    pinned (the memory runs), else glibc's own (the timed run)."""
    run = start(name, flags, log, pinned)
    failed = wait_all([run[-1]])
    return finish(run, failed and failed[1])


def together(names, flags, tmp):
    """The timed runs of engines `names` at once, in lockstep (benchmarks/lockstep.py): {name: what launch gives},
    their step times taken turn by turn, the CPU time of their turns, and wall_s the span of their turns."""
    lock = Lockstep()
    runs = [start(name, flags, os.path.join(tmp, f"timed-{name}.jsonl"), False,
                  lock.spec(i, len(names), int(flags[flags.index("--dp") + 1]), name)) for i, name in enumerate(names)]
    failed = wait_all([run[-1] for run in runs])
    if failed:                                        # its error line (the others were stopped: theirs say less)
        finish(runs[failed[0]], failed[1])
    return {name: finish(run, None) for name, run in zip(names, runs)}


def start(name, flags, log, pinned, turn=None):
    """Start engine `name`'s torchrun (turn: its ranks' lockstep, benchmarks.lockstep.ENV); finish() reads it."""
    script = [os.path.abspath(__file__)] + (["--ours"] + OURS[name] if name in OURS else ["--worker", name])
    d = flags[flags.index("--dp") + 1]
    # $PYTHON as the launchers read it (the tests point it at their zygote's stand-in, tests/python)
    cmd = [os.environ.get("PYTHON", sys.executable), "-m", "mp.tools.torchrun", "--standalone",
           f"--nproc-per-node={d}", "--"] + script
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if pinned:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env.pop(LOCKSTEP_ENV, None)
    if turn:
        env[LOCKSTEP_ENV] = turn
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:   # files: no pipe fills up while we wait
        proc = subprocess.Popen(cmd + flags + ["--log-file", log], env=env, stdout=out, stderr=err, cwd=ROOT)
    return name, flags, log, d, proc


def finish(run, failed):
    """What launch() gives, from a run start() began and wait_all waited for; failed: why it did not end well (it
    or another engine of its lockstep), or None. A failed run: one error line with its torchrun's last words."""
    name, flags, log, d, proc = run
    if failed or proc.returncode:
        with open(f"{log}.err") as f:
            said = f.read()[-2000:]
        sys.exit(f"error: {name} ({' '.join(flags)}) failed ({failed or f'exit status {proc.returncode}'}): {said}")
    ranks_usage = []                                  # each rank's steps_usage file
    for r in range(int(d)):
        with open(f"{log}.usage.{r}") as f:
            ranks_usage.append(json.load(f))
        os.remove(f"{log}.usage.{r}")                 # a later launch with the same log must not read it
    used = {k: sum(u[k] for u in ranks_usage) for k in ("cpu_s", "main_cpu_s", "minor_faults")}
    # the steps' span, from the first rank's set-up end to the last rank's last step: every rank's CPU time falls in it;
    # in lockstep, the span of its turns (each from its first rank's start to its last rank's end), their CPU time in it
    used["wall_s"] = max(u["end"] for u in ranks_usage) - min(u["start"] for u in ranks_usage)
    if "turns" in ranks_usage[0]:
        spans = [u["turns"] for u in ranks_usage]
        used["wall_s"] = engine_span(spans)
        used["turns"] = [[min(b for b, _ in turn), max(e for _, e in turn)] for turn in zip(*spans)]
    with open(log) as f:
        if name not in OURS:
            return {**json.load(f), **used}
        records = [json.loads(line) for line in f]
    s = next(r for r in records if r["event"] == "summary")
    return {**used, "losses": [r["loss"] for r in records if r["event"] == "train"],
            "median_step_time_s": s["median_step_time_s"], "peak_memory_mb": s["peak_memory_mb"],
            "held_mb": [s[k]["0"] for k in ("param_mb", "grad_mb", "optimizer_state_mb")],
            "sent_mb": s.get("dp_sent_mb_per_step", {}).get("0"),
            "peak_grad_mb": s.get("peak_grad_mb", {}).get("0"), "peak_param_mb": s.get("peak_param_mb", {}).get("0")}


def torch_sent(name, n, d):
    """MB a replica of torch's engine sends per step, counted as a ring sends it (by construction)."""
    ring = (d - 1) / d * n
    return {"ddp": 2 * ring, LIKE: 2 * ring, "zero1": 3 * ring, "fsdp2": 2 * ring, "fsdp2-rs": 3 * ring}[name]


def one_round(args, tmp, backwards=False):
    """Every engine of --only once (three torchruns each: the timed runs first, each pair's together in lockstep
    unless --apart), in ORDER, or in its reverse when backwards: the rounds alternate, so that an order effect
    cannot favour one side of a pair (none showed on the vit's --zero 0: 1.06 of DDP with ours always first, and
    alternating; in lockstep the order is who steps first)."""
    common = ["--model", args.model, "--layers", str(args.layers), "--dp", str(args.dp), "--batch-size",
              str(args.batch_size), "--microbatches", "1", "--steps", str(args.steps), "--eval-every", "0",
              "--data", "synthetic", "--optimizer", "adamw", "--seed", "0"]
    out, flags = {}, common + ["--hidden", str(args.hidden)]
    names = [n for n in (ORDER[::-1] if backwards else ORDER) if n in args.only]
    timed_runs = {}
    if not args.apart:        # the timed runs of each pair (or of engines that share one) together, in lockstep
        for group in lockstep_groups(names):
            timed_runs.update(together(group, flags, tmp))
    for name in names:
        timed = timed_runs.get(name) or launch(name, flags, os.path.join(tmp, "timed.jsonl"), pinned=False)
        if args.no_floor:     # the timed run's peak itself (a quick check of the harness; not a memory figure)
            big, tiny = timed, {"peak_memory_mb": {r: 0 for r in timed["peak_memory_mb"]}}
        else:                 # memory: the same run and the tiny model's, the mmap threshold pinned
            big = launch(name, flags, os.path.join(tmp, "big.jsonl"))
            tiny = launch(name, common + ["--hidden", "8"], os.path.join(tmp, "tiny.jsonl"))
            big["pinned_step_time_s"] = big["median_step_time_s"]
            big["median_step_time_s"] = timed["median_step_time_s"]
            big.update({k: timed[k] for k in ("cpu_s", "main_cpu_s", "minor_faults", "wall_s", "turns") if k in timed})
        big["above_floor_mb"] = sum(big["peak_memory_mb"][r] - tiny["peak_memory_mb"][r] for r in big["peak_memory_mb"])
        out[name] = big
        print(f"{name}: {big['median_step_time_s'] * 1e3:.1f} ms, {big['above_floor_mb']:.0f} MB", file=sys.stderr,
              flush=True)
    return out


def lockstep_groups(names):
    """The engines of names whose timed runs take turns (each pair's; a torch engine that two pairs share, with
    both of ours: fsdp2 with --zero 2 and 3 step), in names' order: [[name, ...], ...]."""
    groups = []
    for name in names:
        joined = [g for g in groups if any((name, other) in PAIRS or (other, name) in PAIRS for other in g)]
        merged = [n for g in joined for n in g] + [name]
        groups = [g for g in groups if g not in joined] + [merged]
    return [sorted(g, key=names.index) for g in groups]


def weights_mb(args):
    """N, the model's weights in MB, built here as every engine builds it (a run of the sharding engines alone
    reports 1/D of them)."""
    flags = ["--model", args.model, "--layers", str(args.layers), "--hidden", str(args.hidden)]
    return sum(p.numel() * p.element_size() for p in build_model(baseline_args(flags, __doc__)).parameters()) / 2**20


def autogroup():
    """Is the kernel's autogroup on (Linux; None where there is none to read)? torchrun starts each rank in a
    session of its own, so each rank is then a scheduling group of its own, sharing the cores as one task:
    our ranks' step times swing under it where DDP's do not (docs/benchmarks.md)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def usable_cores():
    """The cores this process, and so every rank it starts, may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine(args):
    """The cores the runs shared and the kernel's autogroup, as the table's last line says them (nothing for a
    file from before they were recorded: --table)."""
    if getattr(args, "cores", None) is None:
        return ""
    group = "" if args.autogroup is None else f", the kernel's autogroup {'on' if args.autogroup else 'off'}"
    return f"; {args.cores} cores{group}"


def timed_how(rounds, args):
    """How the table's runs were made (a --table file from before the timed runs: every run pinned; from before
    lockstep: no turns)."""
    if not any("pinned_step_time_s" in r for r in rounds[0].values()) and not getattr(args, "no_floor", False):
        return "step times and memory with glibc's mmap threshold pinned"
    how = "step times with glibc's own allocator"
    if any("turns" in r for r in rounds[0].values()):
        how += ", each pair's engines in lockstep"
    return how + (", memory with its mmap threshold pinned" if not getattr(args, "no_floor", False) else "")


def ratio(rounds, f):
    """The median over rounds of a per-round ratio ours/torch, and with several rounds the lowest and highest of
    them: `1.01 (0.97-1.05)` says whether a median a little over 1 is the engines or the rounds' spread."""
    values = [f(r) for r in rounds]
    cell = f"{statistics.median(values):.2f}"
    return cell if len(values) == 1 else f"{cell} ({min(values):.2f}-{max(values):.2f})"


def table(rounds, args):
    n = weights_mb(args)
    med = lambda f: statistics.median(f(r) for r in rounds)   # noqa: E731
    peak = "peak" if getattr(args, "no_floor", False) else "peak above floor"
    lines = [f"| ours | torch | {peak}, MB ({args.dp} ranks) ours / torch | ratio | step ms ours / torch | ratio "
             "| held MB (weights, grads, AdamW) ours / torch | sent MB/step ours / torch | max loss diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a, b in [(a, b) for a, b in PAIRS if a in rounds[0] and b in rounds[0]]:
        mem = ratio(rounds, lambda r: r[a]["above_floor_mb"] / r[b]["above_floor_mb"])
        speed = ratio(rounds, lambda r: r[a]["median_step_time_s"] / r[b]["median_step_time_s"])
        diff = max(max(abs(x - y) for x, y in zip(r[a]["losses"], r[b]["losses"])) for r in rounds)
        held = lambda h: ", ".join(f"{x:.1f}" for x in h)   # noqa: E731
        lines.append(f"| --zero {a.replace('-', ' ')} | {b} | {med(lambda r: r[a]['above_floor_mb']):.0f} / "
                     f"{med(lambda r: r[b]['above_floor_mb']):.0f} | {mem} | "
                     f"{med(lambda r: r[a]['median_step_time_s']) * 1e3:.0f} / "
                     f"{med(lambda r: r[b]['median_step_time_s']) * 1e3:.0f} | {speed} | "
                     f"{held(rounds[0][a]['held_mb'])} / {held(rounds[0][b]['held_mb'])} | "
                     f"{rounds[0][a]['sent_mb']:.1f} / {torch_sent(b, n, args.dp):.1f} | {diff:.1e} |")
    lines += where_time_goes(rounds, args, med)
    return "\n".join(lines) + (f"\n\n{args.model} {args.layers} x {args.hidden}, N = {n:.2f} MB of weights, D = "
                               f"{args.dp}, batch {args.batch_size}, one microbatch, AdamW, {args.steps} steps; "
                               f"medians over {len(rounds)} paired rounds (ratios: the median of each round's"
                               f"{', then their range' if len(rounds) > 1 else ''}); "
                               f"{timed_how(rounds, args)}{machine(args)}.")


def where_time_goes(rounds, args, med):
    """The timed runs' CPU time and page faults a step, each side's (every thread of every rank, from set-up's
    end to the last step, step 0 included), the main threads' part of that CPU time, and the share of the
    cores' time over that span that the ranks left idle: where a step-time ratio comes from, since on a shared
    CPU a step is its ranks' CPU time over the cores plus the time the cores sat idle while ranks waited, and
    whether the CPU went to the model's thread or to the collectives'. Nothing for a file from before these
    were recorded (--table); no main-thread or idle column for one from before those were."""
    pairs = [(a, b) for a, b in PAIRS if a in rounds[0] and b in rounds[0] and "cpu_s" in rounds[0][a]]
    if not pairs:
        return []
    per_step = lambda r, name, k: r[name][k] / args.steps   # noqa: E731
    # the share of the cores' time from set-up's end to the last step that no rank used (ranks waiting for each
    # other, or not scheduled): 1 - CPU / (span x cores); from files with the span and the cores only
    idle = "wall_s" in rounds[0][pairs[0][0]] and getattr(args, "cores", None)
    idle_of = lambda r, name: 1 - r[name]["cpu_s"] / (r[name]["wall_s"] * args.cores)   # noqa: E731
    main = "main_cpu_s" in rounds[0][pairs[0][0]]
    kinds = [("cpu_s", 1e3)] + [("main_cpu_s", 1e3)] * main + [("minor_faults", 1)]
    lines = ["", f"| ours | torch | CPU ms a step ({args.dp} ranks) ours / torch | ratio |"
             + (" of which main threads ours / torch | ratio |" if main else "") + " page faults a step "
             "ours / torch | ratio |" + (f" cores idle ({args.cores}) ours / torch |" if idle else ""),
             "| --- | --- |" + " --- | --- |" * len(kinds) + (" --- |" if idle else "")]
    for a, b in pairs:
        cells = [f"{med(lambda r: per_step(r, a, k)) * scale:.0f} / {med(lambda r: per_step(r, b, k)) * scale:.0f}"
                 f" | {ratio(rounds, lambda r: r[a][k] / r[b][k])}" for k, scale in kinds]
        if idle:
            cells.append(f"{med(lambda r: idle_of(r, a)):.1%} / {med(lambda r: idle_of(r, b)):.1%}")
        lines.append(f"| --zero {a.replace('-', ' ')} | {b} | {' | '.join(cells)} |")
    return lines


def bad_input(args):
    """What in the flags cannot make a table (None: nothing)."""
    unknown = [name for name in args.only if name not in ORDER]
    if unknown:
        return f"--only {','.join(unknown)}: no such engine; choose among {','.join(ORDER)}"
    if args.rounds < 1:
        return f"--rounds {args.rounds}: at least one round"
    if args.steps < 2:
        return f"--steps {args.steps}: at least 2 (the step time is the median of the steps after step 0)"
    return None


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3:])
    if len(sys.argv) > 1 and sys.argv[1] == "--ours":
        return ours(sys.argv[2:])
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)   # one error: line
    p.add_argument("--model", choices=["mlp", "vit"], default="mlp",
                   help="the model every engine trains (default: mlp)")
    p.add_argument("--layers", type=int, default=8, help="its hidden layers or blocks (default: 8)")
    p.add_argument("--hidden", type=int, default=1024, help="its width (default: 1024)")
    p.add_argument("--dp", type=int, default=4, help="replicas, one rank each (default: 4)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="the global batch, split over the replicas (default: 64)")
    p.add_argument("--steps", type=int, default=8,
                   help="steps a run; its time is the median after step 0 (default: 8)")
    p.add_argument("--rounds", type=int, default=3,
                   help="paired rounds, every other one in the reverse order; the table gives medians, and each "
                        "ratio's range over the rounds (default: 3)")
    p.add_argument("--out", default=os.path.join(ROOT, "logs", "bench", "data_axis.json"),
                   help="the JSON of every round, written as each ends (default: logs/bench/data_axis.json)")
    p.add_argument("--only", type=lambda s: s.split(","), default=DEFAULT,
                   help=f"the engines to run, comma-separated, among {','.join(ORDER)} (default: all but "
                        f"{LIKE}, DDP with our --zero 0 buckets' cap)")
    p.add_argument("--apart", action="store_true",
                   help="each engine's timed run alone, one after the other, not a pair's together in lockstep "
                        "(benchmarks/lockstep.py)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip each engine's run with the tiny model: memory is then the whole peak, not above its floor")
    p.add_argument("--table", default=None, help="print the table of an earlier run's --out file, run nothing")
    args = p.parse_args()
    problem = bad_input(args)
    if problem:                                  # one line, before anything runs
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        rounds = [{name.replace(" ", "-"): r for name, r in round_.items()} for round_ in saved["rounds"]]
        return print(table(rounds, argparse.Namespace(**{**saved["args"], "dp": saved["args"]["dp"]})))
    args.cores, args.autogroup = usable_cores(), autogroup()   # kept in --out with the flags
    rounds = []
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            rounds.append(one_round(args, tmp, backwards=i % 2 == 1))
        print(f"round {i + 1} of {args.rounds} done (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        with open(args.out + ".tmp", "w") as f:      # every round kept as it ends (--table reads it)
            json.dump({"args": vars(args), "rounds": rounds}, f)
        os.replace(args.out + ".tmp", args.out)
    print(table(rounds, args))


if __name__ == "__main__":
    main()
