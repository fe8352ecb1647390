"""Pipeline parallelism: consecutive stages of one model on consecutive ranks, fed by microbatches.

The lesson (GPipe, Huang et al. 2019; PipeDream-flush 1F1B, Narayanan et al. 2021): cut the model's
blocks into stages, one process each; split every global batch into M microbatches and stream
them through, so that stage r works on microbatch i while stage r+1 works on microbatch i-1.
Gradients of the M microbatches accumulate (each loss divided by M), then every stage takes one
optimizer step: the same update as one process on the whole batch (single_baseline.py).

    torchrun --standalone --nproc-per-node 4 -- pipeline_microbatch.py --data synthetic
    torchrun --standalone --nproc-per-node 4 -- pipeline_microbatch.py --data synthetic --schedule 1f1b --check

GPipe, the default, per clock tick on 4 stages x 4 microbatches (F2: forward of microbatch 2):

    stage 0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3      each arrow between ticks is a message:
    stage 1: .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3         an activation down (send_forward ->
    stage 2: .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3            recv_forward), its gradient back up
    stage 3: .  .  .  F0 F1 F2 F3 B0 B1 B2 B3               (send_backward -> recv_backward)

In order: the stage (each rank keeps only its blocks), the four point-to-point cases over
isend/irecv, the executor that plays a schedule's actions (F, B and the exchanges between them),
the training step, train_step (the batch, zero_grad, the schedule, clip, update; only the last stage
sees labels; the gpt's loss over the GLOBAL batch's valid tokens, mp.loss, and its tied embedding's two
copies, mp.pp.tied). Schedules are data (mp/pp/schedules.py, with zbv's V: chunk to rank, peers); what a
student may skip has one name each: the split backward (mp.pp.zero_bubble: zb's W), 2bw's two weight
versions (mp.pp.pipedream), --recompute, a stage's batch (mp.pp.training.stage_batch), the loop, --check,
the waits' timeouts and gloo's receives posted ahead (mp.pp.p2p).

No deadlock on gloo, whose send completes only once the peer posts the receive: a rank posts the
send of what it just computed together with the receive its next action needs, as one batch
(send_forward_recv_backward, ...), so two neighbours that cross have each posted both halves
(schedules.dry_run() checks every rank's actions for cycles; docs/pipeline.md tells the story).
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

import contextlib
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mp import checkpoint
from mp.cli import pipeline_args
from mp.clipping import clip_global
from mp.data import StreamedInputs, agree_on_data, load_data
from mp.dist import awaiting, distributed, exit_now, group_timeout, one_work_per_op, torchrun_env
from mp.dropout import DropoutKeys
from mp.errors import note_one_rank
from mp.loop import Job, Sums, train
from mp.loss import loss_function
from mp.mesh import Mesh
from mp.models import build_model, num_blocks, zero_sample
from mp.optim import make_optimizer
from mp.pp.balance import resolve_balance
from mp.pp.evaluate import evaluate_pipeline
from mp.pp.p2p import EXCHANGES_AHEAD, EarlyReceives, sends_at_once, sends_kept, wait_message, wait_sends
from mp.pp.pipedream import TwoVersions
from mp.pp.schedules import flow_name, is_mine, peer_of, placement_of, schedule_actions, stage_owner, virtual_stage
from mp.pp.timeline import Timeline, TimelineRecorder
from mp.pp.tied import tie_embeddings, tied_part, tied_stages
from mp.pp.training import Saved, pipeline_check, stage_batch
from mp.pp.zero_bubble import bucket_plan, final_after, run_weight_grads, split_for, split_weight_grads
from mp.sizes import split_sizes

PROGRAM = "pipeline_microbatch"


def parse_args(argv=None):
    args = pipeline_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    resolve_balance(args, stages=torchrun_env("gloo").world_size)   # --balance auto: counted flops
    checkpoint.validate(args)               # the checkpoint to resume from, if any: whole, and of this run
    return args


# ----------------------------------------------------------------------------- stages


@dataclass
class PipelineRank:
    """Who am I in one pipeline: my stage, and my neighbours as global ranks."""
    pp_rank: int
    pp_size: int
    ranks: list          # global rank of each stage of this pipeline
    virtual: int = 1     # model chunks per rank (interleaved, zbv)
    group: object = None  # the process group of this pipeline's ranks (None: all ranks)
    placement: str = "loop"  # where my chunks sit: "loop" (chunk c: virtual stage c*p + r), "v" (zbv)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):              # mine is the model's last chunk (zbv: rank 0, at the V's end)
        return self.pp_rank == stage_owner(self.pp_size * self.virtual - 1, self.pp_size, self.placement)[0]

    @property
    def prev_rank(self):                  # global rank of the stage before mine (None: I am the first)
        return None if self.is_first_stage else self.ranks[self.pp_rank - 1]

    @property
    def next_rank(self):                  # global rank of the stage after mine (None: I am the last)
        return None if self.is_last_stage else self.ranks[self.pp_rank + 1]

    def peer(self, chunk, step):              # global rank and chunk of the virtual stage `step` (+-1) away
        return peer_of(self, chunk, step)     # p*V virtual stages, in a ring or a V (mp.pp.schedules)


def partition(n_blocks, n_chunks, balance=None):
    """Block ranges [start, end) of each chunk: --balance's counts (mp.pp.flags has resolved auto
    into counts), else as even as possible, earlier chunks one larger (tensor_split's sizes)."""
    sizes = [int(b) for b in balance.split(",")] if balance else split_sizes(n_blocks, n_chunks)
    starts = [sum(sizes[:i]) for i in range(n_chunks + 1)]
    return list(zip(starts[:-1], starts[1:]))


def build_stage_model(args, pos, device, shard=None):
    """This rank's blocks and nothing else (the memory contract): the model is built block by block
    from --seed in the baseline's order; each block (parallel_3d.py: its tensor-parallel shard,
    shard(i, block)) takes one zero sample through it, which gives the per-sample shape entering
    every virtual stage, known to both sides of each cut up front (no message carries a shape); then
    the block is kept if it is in one of my chunks and dropped at once if not (a tied gpt's head keeps
    block 0's token embedding, mp.pp.tied). Returns (my blocks, named as in the full model; my chunks:
    virtual stages pp_rank, pp_rank + p, ... (zbv's V: pp_rank, 2p-1-pp_rank); the shapes entering each)."""
    bounds = partition(num_blocks(args), pos.pp_size * pos.virtual, args.balance)
    mine = [range(*bounds[virtual_stage(c, pos.pp_rank, pos.pp_size, pos.placement)]) for c in range(pos.virtual)]
    starts, holds_head = [start for start, _ in bounds], bounds[-1][1] - 1 in mine[-1]   # the model's last block
    shapes, x = [], zero_sample(args, device)       # an image, or the gpt's token ids

    def keep(i, block):
        nonlocal x
        block = (shard(i, block) if shard else block).to(device)
        if i in starts:
            shapes.append(tuple(x.shape[1:]))
        with torch.no_grad():                 # a sharded block runs its tp collectives: my shard's shape
            x = block(x)
        return block if any(i in blocks for blocks in mine) else tied_part(args, i, block, holds_head)

    model = build_model(args, keep, device)
    chunks = [nn.Sequential(*(model.get_submodule(str(i)) for i in blocks)) for blocks in mine]
    return model, chunks, shapes


# ----------------------------------------------------------------------------- point-to-point


class Messenger:
    """The course's four point-to-point cases, named after the data flow (Megatron's names), each
    one message: send_forward, recv_forward, send_backward, recv_backward. A message is (what,
    microbatch, virtual stage of its receiver), what = "act" or "grad". exchange() posts several as
    one batch: a fused pair such as send_forward_recv_backward is the schedules' usual exchange.
    Every message has a tag, so on gloo none can match the wrong receive; nccl ignores tags but
    matches in posting order, and both sides post each direction's messages in the same order
    (tests/test_nccl_order.py). A gloo wait has a timeout that names what it awaited."""

    def __init__(self, pos, shapes, device, timeout_s, ahead=EXCHANGES_AHEAD, sends_at_once=False):
        self.pos, self.shapes, self.device, self.timeout_s = pos, shapes, device, timeout_s
        self.sending = []                     # (work, tensor, part) of the last exchange's sends, not yet waited
        self.sends_at_once = sends_at_once    # zbv on gloo: the step's sends are waited at its end (mp.pp.p2p)
        self.kept = sends_kept(device)        # nccl: sends left in flight at the next sends (mp.pp.p2p)
        self.early = EarlyReceives(ahead, device)   # gloo only: none on nccl (mp.pp.p2p)

    def send_forward(self, y, peer, msg):     # my output, to the next stage's input
        return dist.P2POp(dist.isend, y.contiguous(), peer, None, self.tag(msg))   # the backends send flat memory

    def recv_forward(self, peer, msg, mb_size):   # my input, from the previous stage's output
        return dist.P2POp(dist.irecv, self.buffer(msg, mb_size), peer, None, self.tag(msg))

    def send_backward(self, dx, peer, msg):   # my input's gradient, to the previous stage
        return dist.P2POp(dist.isend, dx.contiguous(), peer, None, self.tag(msg))

    def recv_backward(self, peer, msg, mb_size):  # my output's gradient, from the next stage
        return dist.P2POp(dist.irecv, self.buffer(msg, mb_size), peer, None, self.tag(msg))

    def buffer(self, msg, mb_size):           # an activation: its receiver's input; a gradient: its output
        what, _, vstage = msg
        return torch.empty((mb_size, *self.shapes[vstage + (what == "grad")]), device=self.device)

    def tag(self, msg):
        what, mb, vstage = msg
        return (mb * self.pos.pp_size * self.pos.virtual + vstage) * 2 + (what == "grad")

    def exchange(self, parts, outbox, mb_size, record=None, ahead=(), meanwhile=None):
        """Post every part (send or recv, peer, message) at once, then wait for the receives only: a
        gloo send completes once the peer posts its receive, and waiting for it here would hold my
        next compute in lock step with the next stage. The sends wait until just before the next
        exchange that sends (as torch.distributed.pipelining's 1F1B; zbv on gloo: the step's end; nccl:
        the newest 16 stay), no deadlock. ahead: the next exchanges' receives, posted now (gloo).
        meanwhile(): work that needs no message (the last Bs' Ws), run once the sends are out; True if any."""
        start = time.perf_counter()           # the timeline's wait includes the posting
        if not self.sends_at_once and any(kind == "send" for kind, _, _ in parts):
            self.finish(self.kept)            # the previous exchanges' sends
        posted = self.early.take(parts)       # (op, work) of each receive posted ahead
        fresh = [part for part in parts if part not in posted]
        ops = [self.post(kind, peer, msg, outbox, mb_size) for kind, peer, msg in fresh]
        # one batch: on nccl a send and a receive that cross must share one group call, or both block
        works = one_work_per_op(dist.batch_isend_irecv(ops) if ops else [], ops)   # gloo and nccl differ here
        posted.update(zip(fresh, zip(ops, works)))
        self.early.post(ahead, lambda kind, peer, msg: self.post(kind, peer, msg, None, mb_size))
        if meanwhile and meanwhile():         # work done while the messages travel: the wait starts after it
            start = time.perf_counter()
        ops, works = [posted[part][0] for part in parts], [posted[part][1] for part in parts]
        waited = []
        for (kind, peer, msg), work in zip(parts, works):
            if kind == "recv" and work not in waited:   # a Work is waited once
                self.wait(work, [(kind, peer, msg)])
                waited.append(work)
        self.sending += [(None if work in waited else work, op.tensor, part)   # nccl: done with a receive
                         for part, op, work in zip(parts, ops, works) if part[0] == "send"]
        if record:
            mbs = [m[1] for k, _, m in sorted(parts, key=lambda part: part[0] != "send")]  # in the name's order
            record("wait", f"wait {flow_name(parts)} " + " ".join(f"mb{mb}" for mb in mbs), mbs[-1], start)
        return {msg: op.tensor for (kind, _, msg), op in zip(parts, ops) if kind == "recv"}

    def post(self, kind, peer, msg, outbox, mb_size):
        """One part of an exchange: which of the four cases it is follows from its kind and what it carries."""
        if kind == "send":
            return (self.send_forward if msg[0] == "act" else self.send_backward)(outbox.pop(msg), peer, msg)
        return (self.recv_forward if msg[0] == "act" else self.recv_backward)(peer, msg, mb_size)

    def finish(self, keep=0):                 # before the next sends, and all at the step's end (mp.pp.p2p)
        self.sending = wait_sends(self.sending, keep, self.wait)

    def wait(self, work, parts):              # gloo: at most --timeout-s, then an error naming them (mp.pp.p2p)
        wait_message(work, parts, self.device, self.timeout_s, self.pos.pp_rank)


# ----------------------------------------------------------------------------- the executor


class StageRunner(TimelineRecorder):
    """Runs one rank's action list for one global batch. Saved activations live only between a microbatch's
    forward and its backward, and sent tensors only until their send completes.

    split (mp.pp.zero_bubble): "W" (zb, zbv), the Linear and Conv2d layers' weight gradients in W actions of
    their own; "B" (the others but 2bw), the large Linear layers' added in place after each B, once the next
    exchange has sent B's gradient upstream (gradient-accumulation fusion: the stage before waits for dx, not
    for W). recompute (GPipe's re-materialisation): F runs without autograd, keeping only the chunk's input;
    B re-runs the forward first. versions (2bw): mp.pp.pipedream.TwoVersions, which weights a forward runs
    with, what is stepped and left in flight."""

    def __init__(self, chunks, pos, messenger, split=False, recompute=False, versions=None, keys=None):
        self.chunks, self.pos, self.messenger, self.recompute = chunks, pos, messenger, recompute
        self.stashes = [split_weight_grads(chunk, fused=split == "B") for chunk in chunks] if split else None
        self.fused, self.versions = split == "B", versions
        self.w_inside_b = self.fused and pos.pp_size == 1   # a stage alone: nobody waits for B's dx, W inside B
        self.keys = keys or DropoutKeys(seed=0)   # the model's (setup_stage): its dropout layers read them
        self.norm_groups, self.counted = [pos.group], None   # the gradient norm's sums (mp.clipping)
        self.final_after = final_after(chunks, self.stashes, split)   # whose gradients a last B (W) makes final

    def run(self, actions, inputs, head, mb_size, first_sample=0, grads=None):
        """inputs: microbatches for virtual stage 0 (first stage only), indexed by microbatch and
        read when their forward runs. head(mb, output) -> the scaled loss to differentiate (or None
        when not training), on the last virtual stage. first_sample: the global batch index of
        microbatch 0's first sample (a data-parallel replica's offset), for the dropout masks.
        grads: data parallelism's buckets (mp.buckets), told before a chunk's last backward of the step
        (its last B; under zb its last W) that the gradients it gives are final, and after it and its Ws."""
        training, outbox = torch.is_grad_enabled(), {}
        # (activations kept for a backward, messages received): a flushed pipeline starts empty
        saved, inbox = self.versions.carry_in(training) if self.versions else ({}, {})
        self.mb_size, self.first_sample, self.step = mb_size, first_sample, getattr(self.keys, "step", None)
        recording = self.record if self.events is not None else None
        closing, ws_now = bucket_plan(actions, self.final_after, self.fused) if grads else ({}, ())
        ahead = self.messenger.early.plan(actions)   # gloo: what each exchange posts ahead (mp.pp.p2p)
        run_ws = partial(run_weight_grads, self, grads)   # split "B": the Bs' Ws so far, then the buckets told
        for i, action in enumerate(actions):
            if action[0] == "comm":           # the Bs' Ws run here, once their input gradients are sent
                inbox.update(self.messenger.exchange(action[1], outbox, mb_size, recording, ahead.get(i, ()), run_ws))
                continue
            kind, mb, chunk = action
            if i in closing:                  # a chunk's last backward: each gradient it gives is final, and a
                grads.expect(closing[i])      # bucket starts once all its own are in (all: once its Ws ran)
            start = self.clock()
            if kind == "F":
                self.forward(mb, chunk, inputs, head, saved, outbox, inbox)
            elif kind == "B":
                start = self.backward(mb, chunk, saved.pop((mb, chunk)), outbox, inbox, start, grads)
            elif kind == "W":                 # zb, zbv: an action of its own
                self.stashes[chunk].weight_grads(mb, grads)   # in place, no hook: W tells the buckets itself
            self.record({"F": "forward", "B": "backward", "W": "weight"}[kind], f"{kind}{mb}", mb, start, chunk)
            if i in ws_now:                   # now; split "B": in the next exchange, once its Ws ran (at once
                run_ws()                      # where no exchange follows)
        run_ws()                              # the Ws of Bs with no exchange after them
        self.messenger.finish()
        if self.versions:                     # 2bw: the next batch's first forwards stay in flight
            self.versions.carry_out(saved, inbox, training)
        assert not outbox and (self.versions or not saved and not inbox), "the schedule left work behind"

    def vstage(self, chunk):
        return virtual_stage(chunk, self.pos.pp_rank, self.pos.pp_size, self.pos.placement)

    def is_last(self, chunk):
        return self.vstage(chunk) == self.pos.pp_size * self.pos.virtual - 1

    def key_masks_to(self, mb):
        """Dropout draws microbatch mb's masks: its samples' indices in the global batch key them
        (mp.dropout), so a forward and its recomputation draw the same, and the baseline's."""
        mb, step = self.versions.batch_of(mb, self.step) if self.versions else (mb, self.step)
        self.keys.step, self.keys.first_sample = step, self.first_sample + mb * self.mb_size

    def call(self, chunk, mb, x, training):
        return self.versions.run(chunk, x, mb, training) if self.versions else self.chunks[chunk](x)

    def parameters(self):
        """What the backwards differentiate and the optimizer steps (2bw: one of the two versions), each once."""
        return self.versions.trained() if self.versions else list(nn.ModuleList(self.chunks).parameters())  # zbv: tied

    def update(self, optimizer):
        self.versions.step(optimizer) if self.versions else optimizer.step()

    def forward(self, mb, chunk, inputs, head, saved, outbox, inbox):
        vstage, training = self.vstage(chunk), torch.is_grad_enabled()
        x = inputs[mb] if vstage == 0 else inbox.pop(("act", mb, vstage)).requires_grad_()
        self.key_masks_to(mb)
        with torch.no_grad() if self.recompute else contextlib.nullcontext():
            y = self.call(chunk, mb, x, training)
        if not self.is_last(chunk):
            # zbv's tip: my own next chunk takes it from my inbox, no message (mp.pp.schedules.messages)
            (inbox if is_mine(self.pos, vstage + 1) else outbox)[("act", mb, vstage + 1)] = y.detach()
            if training:                      # kept for the backward, dropped right after it
                saved[(mb, chunk)] = Saved(x, output=None if self.recompute else y)
            return
        if self.recompute and training:       # the loss's own graph is kept: it holds only the logits
            y.requires_grad_()
        loss = head(mb, y)
        if loss is not None and training:
            saved[(mb, chunk)] = Saved(x, logits=y if self.recompute else None, loss=loss)

    def backward(self, mb, chunk, kept, outbox, inbox, start, grads=None):
        """B: the input gradient, which the next exchange sends upstream. Returns B's start time."""
        vstage, last = self.vstage(chunk), self.is_last(chunk)
        output, grad = kept.output, None if last else inbox.pop(("grad", mb, vstage))
        if self.recompute:                    # re-materialise the chunk's activations from its input
            self.key_masks_to(mb)
            output = self.call(chunk, mb, kept.input, True)
            self.record("recompute", f"R{mb}", mb, start, chunk)
            start = self.clock()
            if last:                          # dloss/dlogits through the kept loss graph, then the chunk
                torch.autograd.backward(kept.loss)
                grad = kept.logits.grad
        elif last:
            output = kept.loss
        with self.stashes[chunk].backward_of(mb, self.w_inside_b, grads) if self.stashes else contextlib.nullcontext():
            torch.autograd.backward(output, grad)
        if vstage > 0:                        # (zbv's tip: to my own chunk, through my inbox)
            (inbox if is_mine(self.pos, vstage - 1) else outbox)[("grad", mb, vstage - 1)] = kept.input.grad
        return start


def forward_backward(runner, actions, x, y, m, samples=None, first_sample=0, outputs=None, grads=None, loss_fn=None):
    """One global batch (or this replica's slice) through the schedule, accumulating the batch-mean
    gradient. x: inputs (first stage), y: labels (last stage), samples: the batch size (every stage
    must know it), first_sample: the slice's offset in the global batch, outputs: a dict to keep each
    microbatch's logits in (--check), grads: the data-parallel buckets (StageRunner.run tells them when each
    gradient is final), loss_fn: mp.loss's (the gpt's: over the GLOBAL batch's count). Returns the loss, or None."""
    losses = []

    def head(mb, logits):
        loss = (loss_fn or F.cross_entropy)(logits, y_mb[mb]) / m   # mean of m equal microbatch means (gpt: sum / N)
        losses.append(loss.detach())
        if outputs is not None:
            outputs[mb] = logits.detach()
        return loss

    x_mb = None if not runner.pos.is_first_stage else \
        x if isinstance(x, (StreamedInputs, list)) else x.chunk(m)   # only the first stage reads inputs,
    y_mb = y.chunk(m) if runner.pos.is_last_stage else None          # only the last stage reads labels
    samples = samples or len(x if x is not None else y)
    runner.run(actions, x_mb, head, samples // m, first_sample, grads)
    return torch.stack(losses).sum() if losses else None


# ----------------------------------------------------------------------------- training


def train_step(step, runner, optimizer, actions, data, args, timeline):
    """One optimizer step of the pipeline, in the order it runs. Nothing is read back from the device:
    the loss (on the last stage, else None) and the norm stay tensors, read by the loop (mp.loop)
    every --log-every steps."""
    timeline.begin(step)                  # --timeline: records the steps it draws (else a no-op)
    x, y = stage_batch(data, step, args, runner, runner.messenger.device)   # first stage: inputs, last: labels
    optimizer.zero_grad(set_to_none=True)
    if runner.versions:                   # 2bw: its first step warms up, its last drains
        actions = runner.versions.actions(step)
    with runner.keys.training(step):      # the dropout masks of this step's samples (mp.dropout)
        loss = forward_backward(runner, actions, x, y, args.microbatches, args.batch_size,   # every stage: its size
                                loss_fn=loss_function(args, data, step, pieces=args.microbatches))
    runner.tied.sum_grads()   # one pipeline: only a tied weight's two parts (first, last stage) to sum
    with awaiting(f"rank {dist.get_rank()} waited for the gradient norm's sums of step {step}", args.timeout_s):
        norm = clip_global(runner.parameters(), args.clip_grad_norm, runner.norm_groups, runner.counted)   # all stages
    runner.update(optimizer)              # 2bw: W(t+1) into the older version's buffer, then they swap
    timeline.end(step)
    return loss, norm


def setup_stage(args, env, pos, shard=None, messenger=None):
    """This rank's blocks of the model (only those: build_stage_model; parallel_3d.py shards them, and
    brings its own Messenger) and the runner of its chunks; returns (model, runner)."""
    model, chunks, shapes = build_stage_model(args, pos, env.device, shard)
    messenger = (messenger or Messenger)(pos, shapes, env.device, args.timeout_s,
                                         sends_at_once=sends_at_once(args.schedule, env.device))
    versions = TwoVersions(chunks, pos, args.microbatches, args.steps, model) if args.schedule == "2bw" else None
    return model, StageRunner(chunks, pos, messenger, split=split_for(args.schedule, getattr(args, "zero", 0)),
                              recompute=getattr(args, "recompute", False), versions=versions, keys=model.dropout_keys)


def train_pipeline(args, env, pos, model, runner, data):
    """The optimizer, the action list, and the loop (mp.loop) running train_step; the last stage logs."""
    optimizer = make_optimizer(runner.parameters(), args)
    # my actions, the same every step (zbv on gloo: its sends right after their compute, mp.pp.p2p)
    actions = schedule_actions(args.schedule, pos, args.microbatches, sends_at_once=runner.messenger.sends_at_once)
    timeline = Timeline(args, runner, pos, owner=pos.is_last_stage)
    layout = checkpoint.layout_of(PROGRAM, env, dp=1, pp=pos.pp_size, tp=1, schedule=args.schedule,
                                  virtual_stages=pos.virtual)
    status = train(args, env, Job(
        partial(train_step, runner=runner, optimizer=optimizer, actions=actions, data=data, args=args,
                timeline=timeline),
        model, optimizer, layout, owner=pos.is_last_stage,     # the last stage holds the loss
        evaluate=lambda: evaluate_pipeline(runner, pos, data, env.device),
        sums=Sums(norm_groups=runner.norm_groups), versions=runner.versions.weights if runner.versions else None,
        replicas=runner.tied.replicas()))   # a tied gpt: its first and last stage's copies compared at the end
    timeline.write()                      # the recorded steps' trace (--timeline), gathered once training is over
    return status


def main(argv=None):
    args = parse_args(argv)
    note_one_rank("a pipeline of one stage, every block on this rank")
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        mesh = Mesh.build(env.rank, env.world_size, timeout=group_timeout(env, args.timeout_s),   # one pipeline;
                          tied=tied_stages(args, env.world_size))   # a tied gpt: its embedding group (mp.pp.tied)
        pos = PipelineRank(mesh.pp_rank, mesh.pp_size, mesh.peers("pp"), args.virtual_stages, mesh.pp_group,
                           placement_of(args.schedule))
        model, runner = setup_stage(args, env, pos)
        tie_embeddings(args, model, runner, mesh)   # runner.tied: the gpt's first and last stage (mp.pp.tied)
        if args.check:   # one step against the full model in this process (mp.check)
            status = pipeline_check(env, args, model, runner, data, forward_backward, sum_first=runner.tied.sum_grads)
        else:            # a PipelineError (mp.pp.p2p) ends the run in distributed(), which reports it
            status = train_pipeline(args, env, pos, model, runner, data)
    exit_now(status)


if __name__ == "__main__":
    main()
