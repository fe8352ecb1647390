"""The one training loop, which every program runs with its own step, and the one evaluation.

A program builds what it holds of the model and hands train() a Job: its step (draw the batch, forward,
backward, clip, update: the lesson), and what the loop needs to know around it (what the optimizer
steps, who writes the log, how to evaluate, what a checkpoint holds). The loop does the rest the same
way for every program: resume from a checkpoint, time each step from the batch's drawing on, log it,
evaluate every --eval-every steps, save every --save-every, and write the summary record.
"""
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mp import checkpoint
from mp.data import test_batches
from mp.dist import bounded_wait
from mp.log import MetricsLog, Progress, check_finite, gather_per_rank, memory_fields, start_memory_count
from mp.optim import make_optimizer, optimizer_state_mb


@dataclass
class Job:
    """What one program hands the loop."""
    program: str                    # the name in the log's config record
    model: nn.Module                # what this rank holds, named as in the full model (checkpoints)
    step: Callable                  # step(k, optimizer) -> (step k's loss, a tensor on the ranks that hold it,
                                    # else None; a tensor: its grad norm, or without clipping this rank's
                                    # sum of squares, which finish() turns into the norm: clip_global's value)
    params: list                    # what the optimizer steps
    layout: dict                    # checkpoint.layout_of(...): the layout a checkpoint says wrote it
    owner: bool = True              # this rank writes the log and the console lines
    evaluate: Callable = None       # () -> (test loss, test accuracy), or None where this rank does not report
    versions: Callable = lambda: None   # () -> the weights a checkpoint holds (2bw, --delay 1), None: the model's
    held: Callable = None           # () -> the parameters this rank holds (the summary's param_mb; default: params)
    summary: dict = field(default_factory=dict)   # more fields for the summary record
    awaited: Callable = lambda step: "the step's queued work"   # what a GPU step that never ends waited for
    after_step: Callable = lambda step: None     # after the step's clock stopped (the pipeline's timeline)
    # (losses, norms) of the steps being logged, stacked -> the logged values: the collectives that
    # finish them once for all those steps (data-parallel loss averages, the norms' sums over ranks)
    finish: Callable = lambda losses, norms: (losses, norms)
    optimizer: Callable = make_optimizer          # (params, args) -> the optimizer (--zero 1: mp.zero's)


class StepScalars:
    """The steps' loss, grad norm and time, kept as they come (tensors on the device, CUDA events on a
    GPU) and read in one batch every --log-every steps: a read (.item(), .tolist()) waits for the device to
    finish all the work queued before it, so one in every step would stall a GPU's queue each time, and
    a wait inside the step could not be bounded by our timeouts (mp.dist.bounded_wait bounds this one)."""

    def __init__(self, device, timeout_s):
        self.device, self.timeout_s, self.pending = device, timeout_s, []

    def start(self):
        return self._mark()

    def stop(self, step, start, loss, norm):
        self.pending.append((step, start, self._mark(), loss, norm))

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def read(self, job, awaited):
        """[(step, loss, norm, step time)] of the pending steps (every rank takes part in job.finish's
        collectives; only the owner reads numbers back)."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        losses = [p[3] for p in pending]
        losses = torch.stack(losses).double() if losses[0] is not None else None
        norms = torch.stack([p[4] for p in pending]).double()
        losses, norms = job.finish(losses, norms)
        if not job.owner:
            return []
        if self.device.type == "cuda":   # the one CPU wait on the device's queue, bounded
            bounded_wait(pending[-1][2].query, self.timeout_s, awaited)
            times = [a.elapsed_time(b) / 1e3 for _, a, b, _, _ in pending]
        else:
            times = [b - a for _, a, b, _, _ in pending]
        values = torch.stack([losses, norms]).tolist()   # one read for all the steps
        return [(p[0], loss, norm, t) for p, loss, norm, t in zip(pending, values[0], values[1], times)]


def train(args, env, job):
    """Train job from its checkpoint (or step 0) to --steps; returns the exit status (0)."""
    optimizer = job.optimizer(job.params, args)
    first, written_by = checkpoint.resume(args, job.model, optimizer, env.rank, job.versions())
    log = MetricsLog(args.log_file, enabled=job.owner, resuming=first > 0, steps=args.steps)
    log.begin(job.program, args, env, first, written_by)
    progress = Progress(args.steps, enabled=job.owner)
    scalars = StepScalars(env.device, args.timeout_s)
    start_memory_count(env.device)
    for step in range(first, args.steps):
        start = scalars.start()               # every program times its step from the batch's drawing on
        loss, norm = job.step(step, optimizer)
        scalars.stop(step, start, loss, norm)
        job.after_step(step)
        evaluating = job.evaluate and args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1)
        if (step + 1) % args.log_every == 0 or step == args.steps - 1 or evaluating or saving(args, step):
            for k, loss, norm, step_time in scalars.read(job, lambda: job.awaited(step)):
                check_finite(loss, k)
                log.write("train", step=k, loss=loss, grad_norm=norm, step_time_s=step_time,
                          samples_per_s=args.batch_size / step_time)
                progress.update(k, loss, step_time, args.batch_size)
        if evaluating:
            result = job.evaluate()           # the weights after step's update
            if job.owner and result:
                log.write("eval", step=step, test_loss=result[0], test_acc=result[1])
                print(f"step {step}: test loss {result[0]:.4f}  test accuracy {result[1]:.1%}", flush=True)
        checkpoint.maybe_save(args, step, job.model, optimizer, job.layout, env.rank, job.versions())
    held = job.held() if job.held else job.params
    log.write("summary", steps=args.steps, median_step_time_s=progress.median_step_time(),
              **memory_fields(env, held, job.model.full_param_mb), **optimizer_fields(env, optimizer), **job.summary)
    log.close()
    if job.owner:
        print(f"wrote {args.log_file}", flush=True)
    return 0


def saving(args, step):
    """Is a checkpoint due after this step (checkpoint.maybe_save's rule)? The log is written first, so
    that it holds every step the checkpoint does."""
    return args.checkpoint_dir and ((step + 1) % args.save_every == 0 or step == args.steps - 1)


def optimizer_fields(env, optimizer):
    """The summary's optimizer_state_mb: what each rank's optimizer state takes (param_mb's sibling;
    SGD's momentum: once the parameters, AdamW: twice, --zero 1: divided by the replicas)."""
    return {"optimizer_state_mb": gather_per_rank(env, optimizer_state_mb(optimizer), digits=4)}


@torch.no_grad()
def evaluate(data, device, run, batch=500):
    """Mean test loss and accuracy over the whole test split. run(batches, score) sends a list of
    equal-size (inputs, labels) batches through the model and calls score(i, logits) with batch i's
    logits where they are whole (a pipeline: on its last stage). The full batches go in one call, a
    smaller last batch in a second: a pipeline's messages have one shape per call."""
    batches, totals = test_batches(data, batch), [0.0, 0]
    full = [b for b in batches if len(b[1]) == len(batches[0][1])]
    for part in (full, batches[len(full):]):
        if not part:
            continue

        def score(i, logits, part=part):
            labels = part[i][1].to(device)
            totals[0] += F.cross_entropy(logits, labels, reduction="sum").item()
            totals[1] += (logits.argmax(1) == labels).sum().item()

        run(part, score)
    n = sum(len(y) for _, y in batches)
    return totals[0] / n, totals[1] / n


def whole_model_run(model, device):
    """evaluate()'s run for a model that takes whole batches (the baseline, tensor parallelism)."""
    def run(batches, score):
        for i, (x, _) in enumerate(batches):
            score(i, model(x.to(device)))
    return run
