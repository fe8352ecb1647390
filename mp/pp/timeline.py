"""--timeline: every rank's forwards, backwards and waits of one step on one clock, written as a
Chrome trace (Perfetto opens it; python -m mp.tools.plot_curves --timeline draws it) with the measured and the
theoretical bubble."""
import json
import os
import time

import torch
import torch.distributed as dist

from mp.dist import awaiting
from mp.errors import shared_cores
from mp.pp.schedules import bubble_theory


class TimelineRecorder:
    """The pipeline executor's clock and event log: events is a list while a step is recorded."""
    events = None

    def clock(self):
        """perf_counter; while the timeline records on a GPU, after the queued kernels have run (a
        kernel launch returns at once, so the time would be the CPU's, not the device's)."""
        if self.events is not None and self.messenger.device.type == "cuda":
            torch.cuda.synchronize(self.messenger.device)
        return time.perf_counter()

    def record(self, cat, name, mb, start, chunk=0):
        if self.events is not None:
            self.events.append((cat, name, mb, chunk, start, self.clock()))


def gather_timeline(runner, pos, args):
    """Every rank's events of one step, on one clock: each rank counts from its own time after a
    barrier (skew well under a millisecond on one machine), then all are gathered."""
    origin = runner.origin
    mine = [(cat, name, mb, ch, (t0 - origin) * 1e6, (t1 - t0) * 1e6) for cat, name, mb, ch, t0, t1 in runner.events]
    every = [None] * pos.pp_size
    dist.all_gather_object(every, (pos.pp_rank, mine), group=pos.group)
    # a data-parallel bucket's collective (mp.buckets) runs beside the work: a row (tid) of its own
    events = [{"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": r, "tid": int(cat == "collective"),
               "args": {"microbatch": mb, "chunk": ch}} for r, evs in every for cat, name, mb, ch, ts, dur in evs]
    compute = [e for e in events if e["cat"] not in ("wait", "step", "collective")]   # "step": where a step begins
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    busy = sum(e["dur"] for e in compute) / (pos.pp_size * span)
    return {"traceEvents": events, "otherData": {
        "schedule": args.schedule, "stages": pos.pp_size, "microbatches": args.microbatches,
        "virtual_stages": pos.virtual, "bubble_measured": 1 - busy,
        "bubble_theory": bubble_theory(pos.pp_size, args.microbatches, pos.virtual, args.schedule),
        "recompute": runner.recompute, "steps": sum(e["cat"] == "step" for e in events) // pos.pp_size,
        "device": runner.messenger.device.type, "cpu_cores": os.cpu_count()}}   # ranks > cores: waits for a core


def write_timeline(trace, path, enabled):
    if enabled:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(f"{path}.partial-{os.getpid()}", "w") as f:   # complete or absent under its name
            json.dump(trace, f)
        os.replace(f.name, path)
        other = trace["otherData"]
        why = shared_cores(int(os.environ.get("LOCAL_WORLD_SIZE", other["stages"]))) if other["device"] == "cpu" else ""
        print(f"wrote {path}: bubble measured {other['bubble_measured']:.1%}, theory {other['bubble_theory']:.1%}"
              + (f" ({why}: a stage waiting for a core counts as idle)" if why else ""))


def timeline_steps(args):
    """The steps --timeline records: the last; for 2bw two steady ones (the last step drains)."""
    if args.schedule != "2bw" or args.steps < 2:
        return [args.steps - 1]
    return [max(0, args.steps - 3), args.steps - 2] if args.steps >= 3 else [0, 1]


class Timeline:
    """--timeline over a training run: the step calls begin() first and end() last; recording starts at
    the first of timeline_steps (all ranks together, after a barrier: one clock) and stops after the
    last; write() gathers and writes the trace once training is over (a collective: every rank of the
    pipeline calls it)."""

    def __init__(self, args, runner, pos, owner):
        self.args, self.runner, self.pos, self.owner = args, runner, pos, owner
        self.steps = timeline_steps(args) if args.timeline else []
        self.recorded = None                  # the events of the recorded steps, once recording stopped

    def begin(self, step):
        if self.steps and step == self.steps[0]:
            dist.barrier()                    # one clock for the timeline: everyone starts together
            self.runner.events, self.runner.origin = [], time.perf_counter()
        self.runner.record("step", f"step {step}", None, time.perf_counter())   # a mark, while it records

    def end(self, step):
        if self.runner.events is not None and step == self.steps[-1]:
            self.recorded, self.runner.events = self.runner.events, None

    def write(self):
        if self.recorded is not None:
            self.runner.events, self.recorded = self.recorded, None
            what = f"rank {dist.get_rank()} waited for its pipeline's timelines (--timeline)"
            with awaiting(what, self.args.timeout_s):
                trace = gather_timeline(self.runner, self.pos, self.args)
            write_timeline(trace, self.args.timeline, self.owner)
            self.runner.events = None
