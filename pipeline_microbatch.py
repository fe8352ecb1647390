"""Pipeline parallelism: consecutive stages of one model on consecutive ranks, fed by microbatches.

The lesson (GPipe, Huang et al. 2019; PipeDream-flush 1F1B, Narayanan et al. 2021): cut the model's
blocks into stages, one process each; split every global batch into M microbatches and stream
them through, so that stage r works on microbatch i while stage r+1 works on microbatch i-1.
Gradients of the M microbatches accumulate (each loss divided by M), then every stage takes one
optimizer step: the same update as one process on the whole batch.

What this adds to single_baseline.py (whose data, seeding, optimizer and metrics it shares): each
rank builds and keeps only its stage's blocks of the model (build_stage_model: 1/p of the weights,
gradients and momentum), every message's shape is known up front, activations go forward and
gradients back by isend/irecv (Messenger), a schedule orders each rank's forwards and backwards
(schedule_actions, run by StageRunner), and only the last stage sees labels and the loss
(train_step's head).

    torchrun --standalone --nproc-per-node 4 -- pipeline_microbatch.py --data synthetic --schedule 1f1b
    torchrun --standalone --nproc-per-node 4 -- pipeline_microbatch.py --data synthetic --check

The schedules themselves (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1: who runs which
forward and backward when, and where the messages go) are data, in schedules.py, drawn there tick
by tick; zb's backward split into B and W is zero_bubble.py. This file is the stage, its messages,
the executor that plays a schedule, and the training loop. --recompute (GPipe's re-materialisation)
keeps only each microbatch's stage input from F to B and re-runs the forward just before B; the
first stage draws each microbatch's images when its forward needs them (StreamedInputs).

    torchrun --standalone --nproc-per-node 2 -- pipeline_microbatch.py --data synthetic --schedule zb --recompute

The gloo deadlock, and why these schedules cannot have it. A gloo send does not complete until the
peer posts the matching receive. In the 1F1B steady state (2 stages, counting from 0), stage 0
finishes F1 and sends microbatch 1 forward while stage 1, the last, finishes B0 and sends
microbatch 0's gradient back. If each waits for its own send before posting its next
receive, stage 0 never posts "receive the gradient of 0" and stage 1 never posts "receive the
activation of 1": both block for ever. Here a rank never waits on a send alone: between two
actions it posts the send of what it just computed together with the receive its next action
needs, as one batch (send_forward_recv_backward, send_backward_recv_forward, and for interleaved
the four-way send_forward_backward_recv_forward_backward after each F+B pair), and only then
waits for the receives (its sends are waited for before its next sends: Messenger.exchange).
Two neighbours that cross have each posted both halves, so both exchanges match. This is
checked, not hoped for: schedules.dry_run() plays every rank's action list with blocking sends and names the
first cycle of ranks waiting on each other; the tests run it for many (p, m, v), and show that the
one-message-at-a-time order does deadlock.
"""
import contextlib
import datetime
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
from clipping import clip_global
from common import (CommError, MetricsLog, Progress, awaiting, base_parser, build_model, check_finite, clock,
                    distributed, exit_now, fail, make_optimizer, memory_fields, note_one_rank, num_blocks,
                    start_memory_count, to_device, torchrun_env, validate_common)
from data import agree_on_data, dp_slice, load_data, test_batches
from keyed_dropout import DropoutKeys
from schedules import SCHEDULES, bubble_theory, schedule_actions, with_communication
from zero_bubble import WeightGradStash

PROGRAM = "pipeline_microbatch"


def add_pipeline_flags(p):
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per global batch (per replica)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="interleaved only: model chunks per rank (default: 2; always 1 for the other schedules)")
    p.add_argument("--balance", default=None, help="blocks per stage, e.g. 2,1,1,1 (default: even)")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each microbatch's stage input between its forward and its backward, and "
                        "re-run the forward just before the backward (GPipe's re-materialisation)")
    p.add_argument("--check", action="store_true",
                   help="one step on the first batch against the full model in this process; exit 0 on match")
    return p


def parse_args(argv=None):
    p = add_pipeline_flags(base_parser(__doc__))
    p.add_argument("--timeline", default=None, help="write the last step's measured schedule (Chrome trace)")
    args = p.parse_args(argv)
    validate_common(args, PROGRAM)
    validate_pipeline(args, stages=torchrun_env("gloo").world_size, replicas=1)
    return args


def validate_pipeline(args, stages, replicas, tp=1):
    """Arithmetic of the split, checked from flags and WORLD_SIZE alone: no collective yet.
    tp: ranks per stage (parallel_3d.py), only for the rank counts the messages suggest."""
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule == "interleaved" else 1
    elif args.schedule != "interleaved" and args.virtual_stages != 1:
        fail(f"--virtual-stages {args.virtual_stages} applies only to --schedule interleaved, not "
             f"{args.schedule}; drop it or use --schedule interleaved")
    m, chunks = args.microbatches, stages * args.virtual_stages
    if m <= 0:
        fail(f"--microbatches {m} must be a positive integer")
    if args.batch_size % (replicas * m):
        fail(f"--batch-size {args.batch_size} is not divisible by {replicas} replica(s) x --microbatches {m}; "
             f"use --batch-size {' or --batch-size '.join(map(str, near_multiples(args.batch_size, replicas * m)))}")
    if args.schedule == "interleaved":
        if stages == 1:   # chunk a would send to chunk b on the same rank: a message to itself
            fail("--schedule interleaved needs at least 2 stages (processes); with one, use --schedule "
                 "1f1b or gpipe (the same computation, no messages)")
        if args.virtual_stages < 1:
            fail(f"--virtual-stages {args.virtual_stages} must be a positive integer")
        if m % stages:
            near = [f"--microbatches {k}" for k in near_multiples(m, stages)]
            fail(f"--schedule interleaved needs --microbatches a multiple of the {stages} stages, got {m}; "
                 f"use {' or '.join(near)}, or --schedule 1f1b (without --virtual-stages)")
    if args.balance is not None:
        try:
            balance = [int(b) for b in args.balance.split(",")]
        except ValueError:
            fail(f"--balance {args.balance!r} must be comma-separated integers, e.g. 2,1,1,1")
        if len(balance) != chunks or min(balance) < 1 or sum(balance) != num_blocks(args):
            fail(f"--balance {args.balance} must give {chunks} positive block counts summing to the "
                 f"{num_blocks(args)} blocks of the {args.model}")
    elif chunks > num_blocks(args):
        fail(too_few_blocks(args, stages, replicas * tp))


def near_multiples(n, k):
    """The multiples of k just below and just above n (the one below only if positive)."""
    return sorted({max(k, n // k * k), (n // k + 1) * k})


def too_few_blocks(args, stages, replicas):
    """The message for more model chunks than blocks, with fixes that each work on their own."""
    v, n = args.virtual_stages, num_blocks(args)
    what = f"{stages} pipeline stages" if v == 1 else f"{stages} stages x {v} virtual stages = {stages * v} chunks"
    if v == 1:
        fixes = [f"{n * replicas} ranks (torchrun --nproc-per-node {n * replicas})"]
    else:   # fewer ranks would break the interleaved microbatch rule: change the chunks instead
        fixes = [f"--virtual-stages {n // stages}" if n // stages >= 2
                 else "--schedule 1f1b (without --virtual-stages)"]
    depth = {"cnn": "--model vit --layers", "mlp": "--layers", "vit": "--layers"}[args.model]
    fixes.append(f"{depth} {stages * v - (0 if args.model == 'mlp' else 2)}")   # the vit adds 2 blocks
    return (f"{what} but the {args.model} has only {n} blocks (one chunk needs at least one); "
            f"use {' or '.join(fixes)}")


# ----------------------------------------------------------------------------- stages


@dataclass
class PipelineRank:
    """Who am I in one pipeline: my stage, and my neighbours as global ranks."""
    pp_rank: int
    pp_size: int
    ranks: list          # global rank of each stage of this pipeline
    virtual: int = 1     # model chunks per rank (interleaved)
    group: object = None  # the process group of this pipeline's ranks (None: all ranks)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self):                  # global rank of the stage before mine (None: I am the first)
        return None if self.is_first_stage else self.ranks[self.pp_rank - 1]

    @property
    def next_rank(self):                  # global rank of the stage after mine (None: I am the last)
        return None if self.is_last_stage else self.ranks[self.pp_rank + 1]

    def peer(self, chunk, step):
        """Global rank and chunk of the virtual stage `step` (+1 or -1) away from my `chunk`."""
        v = chunk * self.pp_size + self.pp_rank + step   # virtual stage index, p*V of them in a ring
        return self.ranks[v % self.pp_size], v // self.pp_size


def partition(n_blocks, n_chunks, balance=None):
    """Block ranges [start, end) of each chunk: as even as possible, earlier chunks one larger."""
    sizes = [int(b) for b in balance.split(",")] if balance else \
        [n_blocks // n_chunks + (i < n_blocks % n_chunks) for i in range(n_chunks)]
    starts = [sum(sizes[:i]) for i in range(n_chunks + 1)]
    return list(zip(starts[:-1], starts[1:]))


def build_stage_model(args, pos, device, shard=None):
    """This rank's blocks and nothing else (the memory contract): the model is built block by block
    from --seed in the baseline's order; each block (parallel_3d.py: its tensor-parallel shard,
    shard(i, block)) takes one zero sample through it, which gives the per-sample shape entering
    every virtual stage, known to both sides of each cut up front (no message carries a shape);
    then the block is kept if it is in one of my chunks and dropped at once if not. Returns
    (my blocks, named as in the full model; my chunks: virtual stages pp_rank, pp_rank + p, ...;
    the shapes entering each virtual stage)."""
    bounds = partition(num_blocks(args), pos.pp_size * pos.virtual, args.balance)
    mine = [range(*bounds[c * pos.pp_size + pos.pp_rank]) for c in range(pos.virtual)]
    starts = [start for start, _ in bounds]
    shapes, x = [], torch.zeros(1, 3, 32, 32, device=device)

    def keep(i, block):
        nonlocal x
        block = (shard(i, block) if shard else block).to(device)
        if i in starts:
            shapes.append(tuple(x.shape[1:]))
        with torch.no_grad():                 # a sharded block runs its tp collectives: my shard's shape
            x = block(x)
        return block if any(i in blocks for blocks in mine) else None

    model = build_model(args, keep, device)
    chunks = [nn.Sequential(*(model.get_submodule(str(i)) for i in blocks)) for blocks in mine]
    return model, chunks, shapes


# ----------------------------------------------------------------------------- point-to-point


class Messenger:
    """The point-to-point helpers. One exchange is Megatron's send_forward, recv_forward,
    send_backward, recv_backward, or a fused pair (send_forward_recv_backward, ...: flow_name),
    posted as one batch. Every message has a tag (microbatch, virtual stage, direction), so on gloo
    none can match the wrong receive; nccl ignores tags but matches in order, and both sides post
    each direction's messages in the same order. Every wait has a timeout that names what it awaited."""

    def __init__(self, pos, shapes, device, timeout_s):
        self.pos, self.shapes, self.device, self.timeout_s = pos, shapes, device, timeout_s
        self.sending = []                     # (work, tensor, part) of the last exchange's sends, not yet waited

    def tag(self, msg):
        what, mb, vstage = msg
        return (mb * self.pos.pp_size * self.pos.virtual + vstage) * 2 + (what == "grad")

    def exchange(self, parts, outbox, mb_size, record=None):
        """Post every part of one communication action at once, then wait for its receives only.
        A gloo send completes only once the peer has posted the matching receive; waiting for it
        here would hold this stage's next compute until the next stage is ready, in lock step. So
        the sends (with their tensors, which gloo reads until then) are waited just before the next
        exchange that sends, as torch.distributed.pipelining's 1F1B does: a stage runs at most one
        action ahead of its neighbour, and at most one exchange's sent tensors are alive. Delaying
        a wait cannot create a deadlock: every rank still posts the same messages in the same order,
        and posting never blocks."""
        start = time.perf_counter()           # the timeline's wait includes the posting
        if any(kind == "send" for kind, _, _ in parts):
            self.finish()                     # the previous exchange's sends
        ops, inbox = [], {}
        for kind, peer, msg in parts:
            if kind == "send":
                tensor = outbox.pop(msg)
            else:
                tensor = inbox[msg] = torch.empty((mb_size, *self.shapes[msg[2] + (msg[0] == "grad")]),
                                                  device=self.device)
            ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, None,
                                  self.tag(msg)))
        # one batch: on nccl a send and a receive that cross must share one group call, or both block
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == len(ops):            # gloo: one work per op
            for part, op, work in zip(parts, ops, works):
                if part[0] == "send":
                    self.sending.append((work, op.tensor, part))
                else:
                    self.wait(work, [part])
        else:                                 # nccl: one work for the whole group
            for work in works:
                self.wait(work, parts)
        if record:
            mbs = [m[1] for k, _, m in sorted(parts, key=lambda part: part[0] != "send")]  # in the name's order
            record("wait", f"wait {flow_name(parts)} " + " ".join(f"mb{mb}" for mb in mbs), mbs[-1], start)
        return inbox

    def finish(self):
        """Wait for the sends still in flight (before the next sends, and at the end of a step)."""
        for work, _, part in self.sending:
            self.wait(work, [part])
        self.sending = []

    def wait(self, work, parts):
        try:   # with a timeout, nccl's wait blocks the CPU and raises too (without, it only orders streams)
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            wanted = ", ".join(f"{k} the {'activation' if m[0] == 'act' else 'gradient'} of microbatch "
                               f"{m[1]} {'from' if k == 'recv' else 'to'} rank {peer}" for k, peer, m in parts)
            raise PipelineError(f"stage {self.pos.pp_rank} waited to {wanted} and gave up (timeout "
                                f"{self.timeout_s:g} s): {str(e).splitlines()[0][:160]}") from None


def flow_name(parts):
    """Megatron's name for one exchange, after the data flow: recv_forward (an activation comes in),
    send_backward (a gradient goes out), send_forward_recv_backward, ... send_forward_backward_recv_forward_backward."""
    name = []
    for kind in ("send", "recv"):
        ways = [way for what, way in (("act", "forward"), ("grad", "backward"))
                if any(k == kind and m[0] == what for k, _, m in parts)]
        name += [f"{kind}_{'_'.join(ways)}"] if ways else []
    return "_".join(name)


class PipelineError(CommError):
    pass


# ----------------------------------------------------------------------------- the executor


class StageRunner:
    """Runs one rank's action list for one global batch. Saved activations live only between a
    microbatch's forward and its backward (W, when the backward is split), and sent tensors only
    until their send completes.

    split (--schedule zb): the chunks' Linear and Conv2d layers defer their weight gradients from
    B to W (zero_bubble.py). recompute (--recompute, GPipe's re-materialisation): F runs without
    autograd and keeps only the chunk's input; B first re-runs the forward under autograd."""

    def __init__(self, chunks, pos, messenger, split=False, recompute=False):
        self.chunks, self.pos, self.messenger, self.recompute = chunks, pos, messenger, recompute
        self.stashes = [WeightGradStash(chunk) for chunk in chunks] if split else None
        self.events = None                    # a list while the timeline is recorded
        self.model_param_mb = 0.0             # the whole model's parameters (the summary record): setup_stage
        self.model = None                     # my blocks, named as in the full model (setup_stage): checkpoints
        self.keys = DropoutKeys(seed=0)       # replaced by the model's own (setup_stage): its dropout reads them
        self.norm_groups, self.counted = [pos.group], None   # the gradient norm's sums (clipping.py)

    def clock(self):
        """perf_counter; while the timeline records on a GPU, after the queued kernels have run (a
        kernel launch returns at once, so the time would be the CPU's, not the device's)."""
        if self.events is not None and self.messenger.device.type == "cuda":
            torch.cuda.synchronize(self.messenger.device)
        return time.perf_counter()

    def record(self, cat, name, mb, start, chunk=0):
        if self.events is not None:
            self.events.append((cat, name, mb, chunk, start, self.clock()))

    def run(self, actions, inputs, head, mb_size, first_sample=0):
        """inputs: microbatches for virtual stage 0 (first stage only), indexed by microbatch and
        read when their forward runs. head(mb, output) -> the scaled loss to differentiate (or None
        when not training), on the last virtual stage. first_sample: the global batch index of
        microbatch 0's first sample (a data-parallel replica's offset), for the dropout masks."""
        saved, outbox, inbox = {}, {}, {}
        self.mb_size, self.first_sample = mb_size, first_sample
        for stash in self.stashes or []:
            stash.active = True
        try:
            for action in actions:
                if action[0] == "comm":
                    recording = self.record if self.events is not None else None
                    inbox.update(self.messenger.exchange(action[1], outbox, mb_size, recording))
                    continue
                kind, mb, chunk = action
                start = self.clock()
                if kind == "F":
                    self.forward(mb, chunk, inputs, head, saved, outbox, inbox)
                elif kind == "B":
                    start = self.backward(mb, chunk, saved.pop((mb, chunk)), outbox, inbox, start)
                elif self.stashes:                # W (unsplit layers took their weight gradients in B)
                    self.stashes[chunk].weight_grads(mb)
                self.record({"F": "forward", "B": "backward", "W": "weight"}[kind], f"{kind}{mb}", mb, start, chunk)
        finally:
            for stash in self.stashes or []:
                stash.active = False
        self.messenger.finish()
        assert not saved and not outbox and not inbox, "the schedule left work behind"
        assert not any(stash.pending for stash in self.stashes or []), "a weight gradient was never taken"

    def vstage(self, chunk):
        return chunk * self.pos.pp_size + self.pos.pp_rank

    def is_last(self, chunk):
        return self.vstage(chunk) == self.pos.pp_size * self.pos.virtual - 1

    def key_masks_to(self, mb):
        """Dropout draws microbatch mb's masks: its samples' indices in the global batch key them
        (keyed_dropout.py), so a forward and its recomputation draw the same, and the baseline's."""
        if self.keys is not None:
            self.keys.first_sample = self.first_sample + mb * self.mb_size

    def forward(self, mb, chunk, inputs, head, saved, outbox, inbox):
        vstage, training = self.vstage(chunk), torch.is_grad_enabled()
        x = inputs[mb] if vstage == 0 else inbox.pop(("act", mb, vstage)).requires_grad_()
        self.key_masks_to(mb)
        with torch.no_grad() if self.recompute else contextlib.nullcontext():
            y = self.chunks[chunk](x)
        if not self.is_last(chunk):
            outbox[("act", mb, vstage + 1)] = y.detach().contiguous()   # gloo sends flat memory
            if training:                      # kept for the backward, dropped right after it
                saved[(mb, chunk)] = (x, None if self.recompute else y, None)
            return
        if self.recompute and training:       # the loss's own graph is kept: it holds only the logits
            y.requires_grad_()
        loss = head(mb, y)
        if loss is not None and training:
            saved[(mb, chunk)] = (x, y, loss)

    def backward(self, mb, chunk, kept, outbox, inbox, start):
        """B: the input gradient, which the next exchange sends upstream. Returns B's start time."""
        x, y, loss = kept
        vstage, last = self.vstage(chunk), self.is_last(chunk)
        grad = None if last else inbox.pop(("grad", mb, vstage))
        if self.recompute:                    # re-materialise the chunk's activations from its input
            self.key_masks_to(mb)
            logits, y = y, self.chunks[chunk](x)
            self.record("recompute", f"R{mb}", mb, start, chunk)
            start = self.clock()
            if last:                          # dloss/dlogits through the kept loss graph, then the chunk
                torch.autograd.backward(loss)
                loss, grad = None, logits.grad
        with self.stashes[chunk].backward_of(mb) if self.stashes else contextlib.nullcontext():
            torch.autograd.backward(y if loss is None else loss, grad)
        if vstage > 0:
            outbox[("grad", mb, vstage - 1)] = x.grad.contiguous()
        return start


def train_step(runner, actions, x, y, m, samples=None, first_sample=0):
    """One global batch (or this replica's slice of it) through the pipeline; the accumulated
    gradients are the batch-mean gradient. x: inputs (first stage), y: labels (last stage), samples:
    the batch size, which every stage must know; first_sample: the slice's offset in the global
    batch. Returns the batch-mean loss on the last stage (a tensor: read it after the update), else None."""
    losses = []

    def head(mb, logits):
        loss = F.cross_entropy(logits, y_mb[mb]) / m      # mean of m equal microbatch means
        losses.append(loss.detach())
        return loss

    x_mb = None
    if runner.pos.is_first_stage:                                # only the first stage reads inputs,
        x_mb = x if isinstance(x, StreamedInputs) else x.chunk(m)
    y_mb = y.chunk(m) if runner.pos.is_last_stage else None      # only the last stage reads labels
    samples = samples or len(x if x is not None else y)
    runner.run(actions, x_mb, head, samples // m, first_sample)
    return torch.stack(losses).sum() if losses else None


@torch.no_grad()
def evaluate(runner, pos, data, device, batch=500):
    """A forward-only pipeline over the whole test split; the last stage returns (loss, accuracy).
    Every message has the shape both sides expect: the full batches go through in one pass, a
    smaller last batch in a second pass of its own size."""
    batches, totals = test_batches(data, batch), [0.0, 0]
    full = [b for b in batches if len(b[1]) == len(batches[0][1])]
    for part in (full, batches[len(full):]):
        if not part:
            continue

        def head(mb, logits, part=part):
            labels = part[mb][1].to(device)
            totals[0] += F.cross_entropy(logits, labels, reduction="sum").item()
            totals[1] += (logits.argmax(1) == labels).sum().item()

        inputs = [bx.to(device) for bx, _ in part] if pos.is_first_stage else None
        runner.run(eval_actions(pos, len(part)), inputs, head, len(part[0][1]))
    n = sum(len(y) for _, y in batches)
    return totals[0] / n, totals[1] / n


def eval_actions(pos, n):
    """Forwards only, batch by batch through my chunks. Not chunk by chunk: with interleaving, rank
    p-1 would block sending batch 0 into rank 0's chunk 1 while rank 0 blocks sending batch 2 into
    rank 1's chunk 0 (dry_run finds the cycle)."""
    return with_communication([[("F", mb, c)] for mb in range(n) for c in range(pos.virtual)], pos)


# ----------------------------------------------------------------------------- timeline and check


def gather_timeline(runner, pos, args):
    """Every rank's events of one step, on one clock: each rank counts from its own time after a
    barrier (skew well under a millisecond on one machine), then all are gathered."""
    origin = runner.origin
    mine = [(cat, name, mb, ch, (t0 - origin) * 1e6, (t1 - t0) * 1e6) for cat, name, mb, ch, t0, t1 in runner.events]
    every = [None] * pos.pp_size
    dist.all_gather_object(every, (pos.pp_rank, mine), group=pos.group)
    events = [{"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": r, "tid": 0,
               "args": {"microbatch": mb, "chunk": ch}} for r, evs in every for cat, name, mb, ch, ts, dur in evs]
    compute = [e for e in events if e["cat"] != "wait"]
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    busy = sum(e["dur"] for e in compute) / (pos.pp_size * span)
    return {"traceEvents": events, "otherData": {
        "schedule": args.schedule, "stages": pos.pp_size, "microbatches": args.microbatches,
        "virtual_stages": pos.virtual, "bubble_measured": 1 - busy,
        "bubble_theory": bubble_theory(pos.pp_size, args.microbatches, pos.virtual, args.schedule),
        "recompute": runner.recompute,
        "device": runner.messenger.device.type, "cpu_cores": os.cpu_count()}}   # ranks > cores: waits for a core


def run_check(runner, actions, model, args, x, y, replica=(0, 1), sync_grads=None, reference=None, full_slice=None):
    """One step on the first batch against the full model in this process: the output and loss
    (last stage), every local gradient, and the weights after one optimizer step. With data
    parallelism, replica = (dp_rank, dp) runs this replica's slice and sync_grads averages the
    gradients over replicas before they are compared. With tensor parallelism (parallel_3d.py),
    reference is the full model and full_slice(name, tensor) the part of it this rank holds.
    Returns (tensors compared, largest difference); raises AssertionError naming the first mismatch."""
    reference = build_model(args).to(x.device) if reference is None else reference   # the full model: --check only
    full_slice = full_slice or (lambda name, full: full)
    with reference.dropout_keys.training(0):              # step 0's masks, as in training
        ref_logits = reference(x)
    F.cross_entropy(ref_logits, y).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip_grad_norm or float("inf"))
    make_optimizer(reference.parameters(), args).step()
    x, y, ref_logits = (dp_slice(t, *replica) for t in (x, y, ref_logits.detach()))
    m, outputs, losses, y_mb = args.microbatches, {}, [], y.chunk(args.microbatches)

    def head(mb, logits):                                 # as train_step's, keeping the logits
        outputs[mb] = logits.detach()
        losses.append(F.cross_entropy(logits, y_mb[mb]) / m)
        return losses[-1]

    with runner.keys.training(0):
        runner.run(actions, x.chunk(m) if runner.pos.is_first_stage else None, head, x.shape[0] // m,
                   replica[0] * x.shape[0])
    ours = {id(p) for chunk in runner.chunks for p in chunk.parameters()}
    local = [(name, p) for name, p in model.named_parameters() if id(p) in ours]
    if sync_grads:
        sync_grads([p for _, p in local])
    clip_global([p for _, p in local], args.clip_grad_norm, runner.norm_groups, runner.counted)
    ref = dict(reference.named_parameters())
    pairs = [(f"gradient of {n}", p.grad, full_slice(n, ref[n].grad)) for n, p in local]
    if outputs:
        logits = torch.cat([outputs[i] for i in range(m)])
        pairs += [("output", logits, ref_logits),
                  ("loss (sum of the scaled microbatch losses)", torch.stack(losses).sum().detach(),
                   F.cross_entropy(ref_logits, y))]
    make_optimizer([p for _, p in local], args).step()
    pairs += [(f"weight of {n} after one step", p.detach(), full_slice(n, ref[n].detach())) for n, p in local]
    for name, got, want in pairs:
        torch.testing.assert_close(got, want, msg=lambda msg, name=name: f"{name} differs: {msg}")
    return len(pairs), max((got - want).abs().max().item() for _, got, want in pairs)


def check_and_exit(env, runner, actions, model, args, x, y, **replicas):
    """--check on every rank; rank 0 prints one summary line (and each mismatch, naming its rank),
    and all ranks agree on the exit status (0 match, 1 mismatch)."""
    try:
        count, worst = run_check(runner, actions, model, args, x, y, **replicas)
        mine = (count, worst, None)
    except AssertionError as e:
        mine = (0, float("nan"), str(e).splitlines()[0])
    every = [None] * env.world_size
    dist.all_gather_object(every, mine)                  # one line from rank 0, not one per rank in random order
    if env.rank == 0:
        for rank, (_, _, error) in enumerate(every):
            if error:
                print(f"check: rank {rank}: MISMATCH: {error}", file=sys.stderr, flush=True)
        bad = sum(error is not None for _, _, error in every)
        worst = max((w for _, w, error in every if error is None), default=float("nan"))
        print(f"--check, {args.schedule} on {env.world_size} ranks, model {args.model}: "
              f"{sum(c for c, _, _ in every)} tensors compared with the full model (output and loss on the last "
              f"stage, every rank's local gradients and weights after one step); largest difference {worst:.2e}: "
              f"{f'MISMATCH on {bad} rank(s)' if bad else 'all tensors match the full model'}", flush=True)
    return 1 if any(error for _, _, error in every) else 0


# ----------------------------------------------------------------------------- training


def setup_stage(args, env, pos):
    """This rank's blocks of the model (only those: build_stage_model) and the runner of its chunks;
    returns (model, runner)."""
    model, chunks, shapes = build_stage_model(args, pos, env.device)
    messenger = Messenger(pos, shapes, env.device, args.timeout_s)
    runner = StageRunner(chunks, pos, messenger, split=args.schedule == "zb",
                         recompute=getattr(args, "recompute", False))   # a parser without the flag: off
    runner.model, runner.model_param_mb, runner.keys = model, model.full_param_mb, model.dropout_keys
    return model, runner


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("a pipeline of one stage, every block on this rank")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        pos = PipelineRank(env.rank, env.world_size, list(range(env.world_size)), args.virtual_stages)
        model, runner = setup_stage(args, env, pos)
        actions = schedule_actions(args.schedule, pos, args.microbatches)
        if args.check:
            x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
            status = check_and_exit(env, runner, actions, model, args, x, y)
        else:
            status = train(args, env, pos, runner, actions, data)   # a PipelineError: distributed() reports it
    exit_now(status)


class OneReplica:
    """Data parallelism's hooks, for a single pipeline: the whole batch, nothing to average.
    pipeline_dp_joint.py passes its own, with D replicas and a process group."""
    dp_rank, dp_size, group = 0, 1, None

    def slice(self, tensor):
        return tensor

    def sync_grads(self, params):
        pass

    def average(self, loss):
        return loss


def train(args, env, pos, runner, actions, data, replicas=OneReplica(), program=PROGRAM):
    params = [p for chunk in runner.chunks for p in chunk.parameters()]
    optimizer = make_optimizer(params, args)
    layout = checkpoint.layout_of(program, env, dp=replicas.dp_size, pp=pos.pp_size,
                                  tp=env.world_size // (replicas.dp_size * pos.pp_size), schedule=args.schedule,
                                  virtual_stages=pos.virtual)
    first, written_by = checkpoint.resume(args, runner.model, optimizer, env.rank)   # 0: a fresh run
    # the rank that owns the loss; with tensor parallelism (parallel_3d.py), tp rank 0 of those
    owner = pos.is_last_stage and replicas.dp_rank == 0 and getattr(replicas, "tp_rank", 0) == 0
    log = MetricsLog(args.log_file, enabled=owner, resuming=first > 0)
    log.begin(program, args, env, first, written_by)
    progress = Progress(args.steps, enabled=owner)
    start_memory_count(env.device)
    for step in range(first, args.steps):
        if args.timeline and step == args.steps - 1:
            dist.barrier()                    # one clock for the timeline: everyone starts together
            runner.events, runner.origin = [], time.perf_counter()
        start = time.perf_counter()           # as in every program: from the batch's drawing on
        x, y = next_batch(data, step, args, pos, replicas, env.device, stream=True)
        optimizer.zero_grad(set_to_none=True)
        samples = args.batch_size // replicas.dp_size
        with runner.keys.training(step):
            loss = train_step(runner, actions, x, y, args.microbatches, samples, replicas.dp_rank * samples)
        replicas.sync_grads(params)           # after the last backward, before the update
        with awaiting(f"rank {env.rank} waited for the gradient norm's sums of step {step}", args.timeout_s):
            norm = clip_global(params, args.clip_grad_norm, runner.norm_groups, runner.counted)
        optimizer.step()
        loss = loss.item() if loss is not None else None   # read after the update, as the baseline does
        step_time = clock(env.device) - start   # the optimizer step's kernels included
        if runner.events is not None:
            write_timeline(gather_timeline(runner, pos, args), args.timeline, owner)
            runner.events = None
        if pos.is_last_stage:
            loss = replicas.average(loss)
        if owner:
            check_finite(loss, step)
            log.write("train", step=step, loss=loss, grad_norm=norm, step_time_s=step_time,
                      samples_per_s=args.batch_size / step_time)
            progress.update(step, loss, step_time, args.batch_size)
        if args.eval_every and replicas.dp_rank == 0 and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            result = evaluate(runner, pos, data, env.device)    # replica 0 only: weights are identical
            if owner:
                log.write("eval", step=step, test_loss=result[0], test_acc=result[1])
                print(f"step {step}: test loss {result[0]:.4f}  test accuracy {result[1]:.1%}", flush=True)
        checkpoint.maybe_save(args, step, runner.model, optimizer, layout, env.rank)
    log.write("summary", steps=args.steps, median_step_time_s=progress.median_step_time(),
              **memory_fields(env, params, runner.model_param_mb), schedule=args.schedule,
              microbatches=args.microbatches)
    log.close()
    return 0


def next_batch(data, step, args, pos, replicas, device, stream=False):
    """(inputs, labels) of this step, each only where it is read: the middle stages load nothing.
    stream: the first stage's inputs as StreamedInputs, drawn one microbatch at a time."""
    if pos.is_first_stage and stream:
        x = StreamedInputs(data, step, args.batch_size, args.microbatches, replicas, device)
        labels = data.labels(step, args.batch_size) if pos.is_last_stage else None
        return x, (to_device(replicas.slice(labels), device) if labels is not None else None)
    if pos.is_first_stage:
        x, y = (to_device(replicas.slice(t), device) for t in data.batch(step, args.batch_size))
        return x, (y if pos.is_last_stage else None)
    if pos.is_last_stage:                 # the same samples' labels, without drawing their images
        return None, to_device(replicas.slice(data.labels(step, args.batch_size)), device)
    return None, None


class StreamedInputs:
    """The first stage's microbatches of one step, each drawn from the data set when its forward
    reads it (in order), and held from then on only by the runner, until its backward: the first
    stage never holds the global batch's images, so 1F1B's memory is flat in M there too. Replica d
    of D reads parts d*m .. d*m+m-1 of the global batch cut into D*m: dp_slice's samples."""

    def __init__(self, data, step, batch_size, m, replicas, device):
        parts = data.image_parts(step, batch_size, m * replicas.dp_size)
        self.parts = itertools.islice(parts, replicas.dp_rank * m, None)   # earlier replicas' parts: made, dropped
        self.next_mb, self.samples, self.device = 0, batch_size // replicas.dp_size, device

    def __len__(self):
        return self.samples

    def __getitem__(self, mb):
        assert mb == self.next_mb, f"microbatch {mb} read out of order (expected {self.next_mb})"
        self.next_mb += 1
        return to_device(next(self.parts), self.device)


def write_timeline(trace, path, enabled):
    if enabled:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(trace, f)
        other = trace["otherData"]
        print(f"wrote {path}: bubble measured {other['bubble_measured']:.1%}, theory {other['bubble_theory']:.1%}")


if __name__ == "__main__":
    main()
