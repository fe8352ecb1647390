"""The metrics log (JSON lines from the rank that owns the loss), the console progress line and the
summary record's memory figures."""
import glob
import json
import math
import os
import resource

import torch
import torch.distributed as dist

from mp.dist import settle
from mp.errors import fail, say_when_interrupted
from mp.models import param_mb


def partial_name(path):
    """Where a log is written until its run ends: logs/x.jsonl -> logs/x.partial-<pid>.jsonl (one per
    process, so two runs of the same settings at once never write one file)."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.partial-{os.getpid()}{ext or '.jsonl'}"


class MetricsLog:
    """JSON lines, one record per event, flushed at once so a crash leaves a valid prefix. Only the
    rank that owns the loss writes (enabled=True); the others hold a no-op log.

    The log is complete or absent under its final name: it is written under partial_name(path) and
    renamed to path at close() (an atomic replace in one folder), so an interrupted or failed run
    never touches an earlier run's complete log, and keeps its own partial one under a name that
    says so. A resumed run (a checkpoint at step `start`) takes its earlier records from the newest
    of the two, and deletes the partial log it took them from once its own is complete."""

    def __init__(self, path, enabled, resuming=False, steps=None):
        self.file, self.earlier, self.path, self.steps, self.next_step = None, [], path, steps, 0
        self.partial, self.superseded = partial_name(path), None
        if enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if resuming:                # a resumed run keeps the earlier steps' records
                self.superseded = newest_log(path)
                if self.superseded:
                    with open(self.superseded) as f:
                        self.earlier = [r for r in map(parse_record, f) if r]
            self.file = open(self.partial, "w")
            say_when_interrupted(self.interrupted_line)
        else:
            say_when_interrupted(lambda: None)   # the rank that writes the log speaks for all

    def interrupted_line(self):
        earlier = f"; {self.path} (an earlier run's) is untouched" if os.path.exists(self.path) else ""
        return (f"interrupted at step {self.next_step} of 0-{self.steps - 1}: kept steps 0-{self.next_step - 1} "
                f"in {self.partial}{earlier}" if self.next_step else
                f"interrupted before step 0 finished: kept {self.partial}{earlier}")

    def begin(self, program, args, env, start=0, layout=None):
        """The config record; for a run resumed at step `start`, then the earlier run's train and
        eval records of the steps before it (the dead attempt's later ones are dropped: they are
        trained again) and a resume record."""
        self.config(program, args, env)
        if start:
            for record in self.earlier:
                if record.get("event") in ("train", "eval") and record.get("step", start) < start:
                    self.write(record.pop("event"), **record)
            self.write("resume", step=start, **{"from": layout})

    def write(self, event, **fields):
        if self.file:
            self.file.write(json.dumps({"event": event, **fields}) + "\n")
            self.file.flush()
            if event == "train":
                self.next_step = fields["step"] + 1

    def config(self, program, args, env):
        self.write("config", program=program, args=vars(args), world_size=env.world_size,
                   backend=env.backend, device=str(env.device))

    def close(self):
        """The run is complete: its log takes its final name."""
        if self.file:
            self.file.close()
            os.replace(self.partial, self.path)
            if self.superseded and self.superseded != self.path and os.path.exists(self.superseded):
                os.remove(self.superseded)   # its records are in the complete log now
        say_when_interrupted(lambda: None)


def newest_log(path):
    """The newest of path and its partial logs (a killed attempt's), or None."""
    stem, ext = os.path.splitext(path)
    found = [p for p in [path] + glob.glob(glob.escape(stem) + ".partial-*" + (ext or ".jsonl")) if os.path.exists(p)]
    return max(found, key=os.path.getmtime, default=None)


def parse_record(line):
    try:
        return json.loads(line)
    except ValueError:    # a line cut short by a crash
        return None


class Progress:
    """A short console line every few steps, and the step times for the summary. Steps are numbered
    from 0 here as in the metrics log and the plots: the last of 300 is `step 299 (of 0-299)`. The
    lines fall on the same steps in every program with the same --steps (every `every(total)` steps,
    and the last), so a baseline's console and a parallel run's compare line by line; a clock would
    pick different steps in each."""

    def __init__(self, total_steps, enabled):
        self.total, self.enabled, self.every = total_steps, enabled, every(total_steps)
        self.step_times = []

    def update(self, step, loss, step_time, samples):
        self.step_times.append(step_time)
        if self.enabled and (step % self.every == 0 or step == self.total - 1):
            print(f"step {step} (of 0-{self.total - 1})  loss {loss:.4f}  {samples / step_time:.0f} samples/s",
                  flush=True)

    def median_step_time(self):
        times = sorted(self.step_times[1:] or self.step_times)  # step 0 pays warm-up costs
        return times[len(times) // 2] if times else float("nan")


def every(total, lines=15):
    """Steps between two progress lines: a round number (1, 2, 5, 10, 20, 25, 50, ...) that gives at
    most about `lines` lines: 300 steps, a line every 20; 30 steps, every 2."""
    for step in (1, 2, 5, 10, 20, 25, 50):
        if total <= step * lines:
            return step
    return every(total // 10, lines) * 10


def check_finite(loss, step):
    if not math.isfinite(loss):
        fail(f"the loss became {loss} at step {step}; training stopped (try a smaller --lr)", seen_by="this rank")


def start_memory_count(device):
    """Call after set-up: on a GPU the peak counts from here (the CPU's peak RSS cannot be reset,
    so it includes set-up: see memory_fields' label)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device, kind="allocated"):
    """This process's peak resident set (CPU), or the peak of GPU memory held by tensors
    (allocated) or by PyTorch's caching allocator (reserved, what the GPU actually lost), in MB."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved if kind == "reserved" else torch.cuda.max_memory_allocated
        return peak(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KB


def gather_per_rank(env, value, digits=1):
    """{rank: value} from every rank (a collective: every rank must call it)."""
    mine = torch.tensor([value], dtype=torch.float64, device=env.device)
    if env.world_size == 1:
        return {0: round(mine.item(), digits)}
    every = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)
    settle(env.device, env.timeout_s, lambda: f"rank {env.rank}'s all-gather of the summary's numbers")
    return {r: round(t.item(), digits) for r, t in enumerate(every)}


def gather_peak_memory(env, kind="allocated"):
    return gather_per_rank(env, peak_memory_mb(env.device, kind))


def memory_fields(env, params, model_param_mb):
    """The summary record's memory, labelled so that CPU and GPU tables are not mixed up:
    peak_memory_mb is peak RSS on the CPU, peak allocated on a GPU (plus peak_reserved_mb).
    param_mb: what each rank's parameters take (gradients and momentum take as much again each);
    model_param_mb: the whole model's, which a pipeline's stages sum to."""
    fields = {"param_mb": gather_per_rank(env, param_mb(params), digits=4), "model_param_mb": round(model_param_mb, 4)}
    if env.device.type != "cuda":
        return {"peak_memory_mb": gather_peak_memory(env),
                "peak_memory_kind": "cpu peak RSS of the process (includes set-up)", **fields}
    return {"peak_memory_mb": gather_peak_memory(env), "peak_reserved_mb": gather_peak_memory(env, "reserved"),
            "peak_memory_kind": "cuda peak allocated by tensors since set-up (peak_reserved_mb: by the allocator)",
            **fields}
