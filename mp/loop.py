"""The one training loop, which every program runs with its own step, and the one evaluation.

A program writes its step out in its own file (draw the batch, zero the gradients, forward and
backward, synchronise, clip, update: the lesson) and hands train() that step with the few things the
loop needs around it (a Job). The loop does the rest the same way for every program: resume from a
checkpoint, time each step from the batch's drawing on, read the steps' scalars every --log-every
steps and log them, evaluate every --eval-every steps, save every --save-every, write the summary.
"""
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from mp import checkpoint
from mp.check import report_replicas
from mp.clipping import finish_norms
from mp.data import test_batches
from mp.ep.routing import complete_routing
from mp.dist import awaiting, settle
from mp.loss import token_sum
from mp.log import MetricsLog, Progress, check_finite, gather_per_rank, memory_fields, start_memory_count
from mp.models import param_mb
from mp.moe import expert_load, read_load
from mp.optim import counting, every_param_whole, grad_mb, optimizer_state_mb
from mp.sizes import EVAL_BATCH
from mp.traffic import METER


@dataclass
class Sums:
    """The collectives that finish the logged scalars, once for all the steps being logged (every
    --log-every steps), so that no step waits for them: the loss averaged over the data-parallel
    replicas (each replica's last stage holds its slice's mean), and without clipping the gradient
    norm's sums of squares summed over the groups that split the model (each rank kept its own)."""
    replicas: object = None       # the data-parallel group whose losses are averaged (None: one replica)
    norm_groups: list = None      # the groups the squares are summed over (None: the step's norm is whole)
    routing: object = None        # the pipeline group over which the stages' routing records are gathered for
                                  # the summary, after the last step (parallel_5d.py; None: mine is whole)
    pieces: object = None         # a group whose ranks' losses are pieces of one loss, summed (the gpt under
                                  # context parallelism: each rank's tokens' sum / the batch's count; None: whole)


@dataclass
class Job:
    """What a program hands the loop: its step, and what the loop needs around it."""
    step: Callable                # step(k) -> (step k's loss: a tensor on the ranks that hold it, else None;
                                  # its grad norm, a tensor: without clipping, this rank's sum of squares
                                  # where sums.norm_groups says so)
    model: nn.Module              # what this rank holds, named as in the full model (checkpoints)
    optimizer: object             # what the step updates with (checkpoints keep its state)
    layout: dict                  # checkpoint.layout_of(program, ...): the program and its layout
    owner: bool = True            # this rank writes the log and the console lines
    evaluate: Callable = None     # () -> [test loss, test accuracy] on the device; None: this rank reports none
    sums: Sums = field(default_factory=Sums)
    versions: list = None         # [(name, current, stale, stepped)]: the weights a checkpoint holds under
                                  # 2BW's rule (2bw, --delay 1; kept up to date by their owner); None: the model's
    collectives: str = None       # what the step and the evaluation wait for ("the tensor-parallel
                                  # collectives"): a timeout names it, with the step (mp.dist.awaiting)
    replicas: list = field(default_factory=list)   # [Replicas]: compared after the last step (mp.check)


@dataclass
class Replicas:
    """Tensors that several ranks hold and must keep bit-identical (same start, gradient, update): after
    the run, rank 0 prints `claim: yes` (or NO, and the run exits 1), mp.check.report_replicas."""
    params: list
    group: object
    claim: str                    # "replicated parameters bit-identical across the 2 tensor-parallel ranks"
    zero: int = 0                 # --zero on a data-parallel group: the same bytes by construction, not compared
    uneven: bool = False          # groups of this name differ in size: every rank joins (mp.check.report_replicas)


class StepScalars:
    """The steps' loss, grad norm and time, kept as they come (tensors on the device, CUDA events on a
    GPU) and read in one batch every --log-every steps: a read (.item(), .tolist()) waits for the device to
    finish all the work queued before it, so one in every step would stall a GPU's queue each time, and
    a wait inside the step could not be bounded by our timeouts (mp.dist.settle bounds this one)."""

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

    def read(self, job, args, rank):
        """[(step, loss, norm, step time)] of the pending steps (every rank takes part in finish()'s
        collectives; only the owner reads numbers back)."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        losses = [p[3] for p in pending]
        losses = torch.stack(losses).double() if losses[0] is not None else None
        norms = torch.stack([p[4] for p in pending]).double()
        losses, norms = finish(losses, norms, job.sums, args, rank)
        # the one CPU wait on the device's queue (a GPU), bounded, on every rank: up to after finish()'s
        # collectives, so that a peer lost in the steps or in those (nccl) ends here with a named error
        settle(self.device, self.timeout_s, lambda: f"step {pending[-1][0]}'s queued work and the logged values' sums")
        read_load(job.model)   # --experts: the steps' routing record to the host (one read), so it never grows there
        if not job.owner:
            return []
        if self.device.type == "cuda":
            times = [a.elapsed_time(b) / 1e3 for _, a, b, _, _ in pending]
        else:
            times = [b - a for _, a, b, _, _ in pending]
        values = torch.stack([losses, norms]).tolist()   # one read for all the steps
        return [(p[0], loss, norm, t) for p, loss, norm, t in zip(pending, values[0], values[1], times)]


def finish(losses, norms, sums, args, rank):
    """The logged values of several steps (stacked) from what the steps returned (Sums says how)."""
    with awaiting(f"rank {rank} waited for the logged losses' and norms' sums", args.timeout_s):
        if losses is not None and sums.replicas is not None:   # nccl reduces GPU tensors only: they are
            dist.all_reduce(losses, group=sums.replicas)
            losses = losses / dist.get_world_size(sums.replicas)
        if losses is not None and sums.pieces is not None:
            dist.all_reduce(losses, group=sums.pieces)
        if sums.norm_groups is not None:
            norms = finish_norms(norms, sums.norm_groups, args.clip_grad_norm is not None)
    return losses, norms


def train(args, env, job):
    """Train job from its checkpoint (or step 0) to --steps; returns the exit status (0)."""
    optimizer, program = job.optimizer, job.layout["program"]
    with counting(optimizer, "resume"):   # --zero 3: its peak of weights held, apart from a step's
        first, written_by = checkpoint.resume(args, job.model, optimizer, env.rank, job.versions)
    phases = ["resume"] if first else []
    log = MetricsLog(args.log_file, enabled=job.owner, resuming=first > 0, steps=args.steps)
    log.begin(program, args, env, first, written_by)
    progress = Progress(args.steps, enabled=job.owner)
    scalars = StepScalars(env.device, args.timeout_s)
    start_memory_count(env.device)
    for step in range(first, args.steps):
        start = scalars.start()               # every program times its step from the batch's drawing on
        tracing = getattr(args, "trace_collectives", False) and step == first and env.rank == 0
        with waiting_for(job, env, args, f"step {step}"), METER.counting(trace=tracing):
            loss, norm = job.step(step)       # every message it sends counted by group (mp/traffic.py)
        scalars.stop(step, start, loss, norm)
        if tracing:
            print_trace(METER.trace, step)
        evaluating = job.evaluate and args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1)
        if (step + 1) % args.log_every == 0 or step == args.steps - 1 or evaluating or saving(args, step):
            for k, loss, norm, step_time in scalars.read(job, args, env.rank):
                check_finite(loss, k)
                log.write("train", step=k, loss=loss, grad_norm=norm, step_time_s=step_time,
                          samples_per_s=args.batch_size / step_time)
                progress.update(k, loss, step_time, args.batch_size)
        if evaluating:
            with waiting_for(job, env, args, "the evaluation"), counting(optimizer, "evaluation"):
                result = job.evaluate()       # the weights after step's update; on the device, read here once
                if result is not None:
                    settle(env.device, args.timeout_s, lambda: f"the evaluation after step {step}")
                    result = result.tolist()
            if job.owner and result:
                report_evaluation(log, args, step, *result)
            phases += [] if "evaluation" in phases else ["evaluation"]
        checkpoint.maybe_save(args, step, job.model, optimizer, job.layout, env.rank, job.versions)
    if job.sums.routing is not None:      # outside the steps: it reads the device and talks to every stage
        with waiting_for(job, env, args, "the stages' routing records"):
            complete_routing(job.model, job.sums.routing)
    log.write("summary", steps=args.steps, median_step_time_s=progress.median_step_time(),
              **memory_fields(env, held(job), job.model.full_param_mb), **optimizer_fields(env, job.model, optimizer),
              **activation_fields(env, job.model), **attention_fields(env, job.model),
              **data_parallel_fields(env, job, args.steps - first, phases),
              **expert_fields(env, job.model, args.steps - first), **traffic_fields(env, args.steps - first),
              **{k: getattr(args, k) for k in ("schedule", "microbatches") if hasattr(args, k)})   # a pipeline's
    log.close()
    if job.owner:
        print(f"wrote {args.log_file}", flush=True)
    with every_param_whole(optimizer):    # --zero 3: the weights gathered whole for the comparison (collectives)
        return max([report_replicas(r.params, r.group, r.claim, env, args.timeout_s, r.zero, r.uneven)
                    for r in job.replicas], default=0)


def report_evaluation(log, args, step, loss, accuracy):
    """The eval record and its console line; the gpt's also in bits per byte (its loss is in nats per byte)."""
    if args.model != "gpt":
        log.write("eval", step=step, test_loss=loss, test_acc=accuracy)
        print(f"step {step}: test loss {loss:.4f}  test accuracy {accuracy:.1%}", flush=True)
        return
    log.write("eval", step=step, test_loss=loss, test_acc=accuracy, test_bits_per_byte=loss / math.log(2))
    print(f"step {step}: test loss {loss:.4f} ({loss / math.log(2):.3f} bits per byte)  next-byte accuracy "
          f"{accuracy:.1%}", flush=True)


def print_trace(lines, step):
    """--trace-collectives: what rank 0 sent in its first step, in the order it ran (mp.traffic.Meter)."""
    print(f"--trace-collectives: rank 0's step {step}, every collective and point-to-point send in the order it ran "
          f"(group {{its ranks}}, the tensor, the bytes this rank sends as a ring moves them: mp/traffic.py):",
          flush=True)
    for line in lines or ["  (none: this rank sent nothing in the step)"]:
        print(line, flush=True)


def traffic_fields(env, steps):
    """The summary's sent_mb_per_step: {group: {rank: MB}}, what each rank sent over each group a training step
    (mp.traffic: every collective and point-to-point send of the steps, as a ring moves it). The groups are every
    rank's (an all-gather of the names: a rank that sent nothing over a group says 0)."""
    if env.world_size == 1:
        return {}
    names = [None] * env.world_size
    dist.all_gather_object(names, sorted(METER.bytes))
    return {"sent_mb_per_step": {name: gather_per_rank(env, METER.bytes.get(name, 0) / 2**20 / max(steps, 1), digits=6)
                                 for name in sorted(set().union(*names))}}


def waiting_for(job, env, args, what):
    """A communication failure inside (gloo) becomes one error line naming what this rank waited for
    (`rank 1 waited for the tensor-parallel collectives of step 7, and gave up`); none where the
    program names nothing."""
    if job.collectives is None:
        return contextlib.nullcontext()
    return awaiting(f"rank {env.rank} waited for {job.collectives} of {what}", args.timeout_s)


def held(job):
    """The weights this rank holds between steps (the summary's param_mb): the model's, and under 2BW's
    rule the version before the last update too; --zero 3: its slices (and any whole weight not freed)."""
    slices = getattr(job.optimizer, "held_params", lambda: None)()   # --zero 3: my slices of the weights,
    if slices is not None:              # and any whole weight still in memory (none: all were freed)
        return slices + [p for p in job.model.parameters() if p.untyped_storage().nbytes()]
    if job.versions is None:
        return list(job.model.parameters())
    tensors = {}
    for _, current, stale, _ in job.versions:
        tensors.update({id(t): t for t in (current, stale) if t is not None})
    return list(tensors.values())


def saving(args, step):
    """Is a checkpoint due after this step (checkpoint.maybe_save's rule)? The log is written first, so
    that it holds every step the checkpoint does."""
    return args.checkpoint_dir and ((step + 1) % args.save_every == 0 or step == args.steps - 1)


def activation_fields(env, model):
    """The summary's activation_mb, where the program measures it (model.saved_activations, a
    mp.cp.memory.SavedActivations: context_parallel.py): the bytes autograd saved for one step's backward."""
    saved = getattr(model, "saved_activations", None)
    return {} if saved is None else {"activation_mb": gather_per_rank(env, saved.mb(), digits=4)}


def attention_fields(env, model):
    """The summary's attention_flops, where the program counts them (model.attention_work, a
    mp.cp.zigzag.AttentionWork: context_parallel.py): the attention's multiply-adds in a step's forward, per rank."""
    work = getattr(model, "attention_work", None)
    return {} if work is None else {"attention_flops": gather_per_rank(env, work.last, digits=0)}


def optimizer_fields(env, model, optimizer):
    """The summary's grad_mb and optimizer_state_mb, param_mb's siblings: what each rank's gradients
    take after the last step (as much as its parameters; --zero 2: divided by the replicas) and its
    optimizer state (SGD's momentum: once the parameters, AdamW: twice; --zero 1 and 2: divided by the
    replicas)."""
    return {"grad_mb": gather_per_rank(env, grad_mb(model.parameters(), optimizer), digits=4),
            "optimizer_state_mb": gather_per_rank(env, optimizer_state_mb(optimizer), digits=4)}


def expert_fields(env, model, steps):
    """--experts: the routing record (mp.moe.expert_load: tokens per expert per step, choices dropped) and,
    where the experts are spread over the ranks (model.all_to_all, expert_parallel.py), the MB each rank's
    all-to-alls sent to other ranks per training step."""
    fields = expert_load(model) or {}
    traffic = getattr(model, "all_to_all", None)
    if traffic is not None:
        fields["all_to_all_mb_per_step"] = gather_per_rank(env, traffic.bytes / 2**20 / max(steps, 1), digits=6)
    return fields


def data_parallel_fields(env, job, steps, phases=()):
    """The summary's dp_sent_mb_per_step, where the program has data-parallel buckets (model.grad_buckets,
    mp.buckets.GradBuckets, which count what each rank sent in them per step, as a ring sends it),
    peak_grad_mb (the most gradient bytes it held at once: the buckets and --zero 2's accumulators,
    counted where they are made and let go) and peak_param_mb (the most weights: under --zero 3 its
    slices and the blocks gathered, mp.param_shards; else every weight, always held). --zero 3: also
    resume_peak_param_mb and eval_peak_param_mb, the most weights held in the resume and in an evaluation
    (phases: those that ran), which gather no more than a step does."""
    grads = getattr(job.model, "grad_buckets", None)
    if grads is None:
        return {}
    shards = getattr(job.optimizer, "shards", None)
    fields = {"dp_sent_mb_per_step": gather_per_rank(env, grads.sent_bytes / 2**20 / max(steps, 1), digits=4),
              "peak_grad_mb": gather_per_rank(env, grads.peak_mb(), digits=4),
              "peak_param_mb": gather_per_rank(env, shards.peak_mb() if shards else param_mb(held(job)), digits=4)}
    for phase in phases if shards else ():
        name = {"resume": "resume_peak_param_mb", "evaluation": "eval_peak_param_mb"}[phase]
        fields[name] = gather_per_rank(env, shards.peak_mb(phase), digits=4)
    return fields


@torch.no_grad()
def evaluate(data, device, run, batch=EVAL_BATCH, replica=None, scores=None):
    """Mean test loss and accuracy over the whole test split (the gpt: over its tokens, each a prediction of
    the next byte; the test split leaves none out: every label counts). run(batches, score) sends a list of
    equal-size (inputs, labels) batches through the model and calls score(i, logits) with batch i's
    logits where they are whole (a pipeline: on its last stage). The full batches go in one call, a
    smaller last batch in a second: a pipeline's messages have one shape per call.
    replica=(d, D, group): I am replica d of D and run my contiguous slice of every batch (as a step slices
    its batch; where D does not divide a batch, the first replicas take one sample more), and the replicas'
    sums are added over group; every member calls it, the sums of a rank that scores nothing are zeros.
    scores(logits, labels) -> (the loss's sum, the correct answers), for logits that are not whole (tensor
    parallelism's vocabulary columns: mp.tp.vocab); None: whole_model_scores.
    Returns [mean loss, accuracy], float64 on the device, unread: the loop reads it once its work is done
    (settle), so a peer lost on a GPU ends in one error line, not a read that waits for nccl's watchdog."""
    batches = test_batches(data, batch)
    totals = torch.zeros(2, dtype=torch.float64, device=device)   # the loss's sum, the correct answers
    n = sum(y.numel() for _, y in batches)   # every label counts: the test split has no IGNORE (and no read)
    if replica is not None:
        d, parts, group = replica
        batches = [(x.tensor_split(parts)[d], y.tensor_split(parts)[d]) for x, y in batches]
    full = [b for b in batches if len(b[1]) == len(batches[0][1])]
    for part in (full, batches[len(full):]):
        if not part:
            continue

        def score(i, logits, part=part):
            labels = part[i][1].to(device)
            loss, right = (scores or whole_model_scores)(logits, labels)
            totals[0] += loss.double()   # as .item() gave it
            totals[1] += right

        run(part, score)
    if replica is not None:                   # the whole split's sums: every replica's slices added
        dist.all_reduce(totals, group=group)
    return totals / n


def whole_model_scores(logits, labels):
    """evaluate()'s scores of whole logits: the loss's sum over the tokens (or images), the correct answers."""
    return token_sum(logits, labels), (logits.argmax(-1) == labels).sum()


def whole_model_run(model, device):
    """evaluate()'s run for a model that takes whole batches (the baseline, tensor parallelism)."""
    def run(batches, score):
        for i, (x, _) in enumerate(batches):
            score(i, model(x.to(device)))
    return run
