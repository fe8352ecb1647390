"""The pieces the three pipeline programs share around their own steps: this step's inputs and labels
where a stage reads them (stage_batch), and --check's step (check_step, pipeline_check). Each program
writes its training step out in its own file; these are plain functions it calls by name, and Saved, what a
microbatch's forward leaves for its backward in pipeline_microbatch.py's executor."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mp.check import check_and_exit
from mp.data import next_batch
from mp.loss import loss_function
from mp.pp.pipedream import pipedream_inputs
from mp.pp.schedules import schedule_actions
from mp.tp.collectives import tp_size
from mp.tp.mappings import gather_from_tp_region
from mp.tp.vocab import tp_loss_function


@dataclass
class Saved:
    """What a microbatch's forward leaves for its backward on one chunk, until B (W, when split)."""
    input: torch.Tensor           # the chunk's input; B sends its .grad upstream
    output: torch.Tensor = None   # what B differentiates on a middle chunk (None under --recompute)
    logits: torch.Tensor = None   # the last chunk's output, under --recompute (the loss's graph starts there)
    loss: torch.Tensor = None     # the last chunk's scaled loss: B differentiates it


def stage_batch(data, step, args, runner, device, replica=(0, 1)):
    """(inputs, labels) of step `step` where this stage reads them (mp.data.next_batch): the first
    stage its inputs, drawn one microbatch at a time as their forwards read them; the last stage its
    labels; a middle stage nothing. replica = (dp_rank, dp_size): a data-parallel replica draws its
    slice only. 2bw's first stage also draws the next batch, whose first forwards run in this step."""
    x, y = next_batch(data, step, args, runner.pos, device, replica, stream=not runner.versions)
    if runner.versions and runner.pos.is_first_stage:
        x = pipedream_inputs(x, data, step, args, runner.pos, replica, device)
    return x, y


def check_step(runner, actions, m, forward_backward, replica=(0, 1), grads=None, sum_first=None,
               loss_fn=F.cross_entropy, shards=None, vocab_group=None):
    """--check's step (mp.check) for a pipeline: the program's forward_backward on the first batch (this
    replica's slice), keeping the logits, then the gradients synchronised as in training: sum_first()
    (parallel_3d.py's tensor-parallel sums, a tied embedding's two stages), then the data-parallel buckets
    (grads). loss_fn: a microbatch's loss before the 1/M (mp.loss.loss_function). shards (--zero 3): the
    whole weights let go after the backward, as the training step does (a late bucket's, the tied
    embedding's, are let go only there). vocab_group (parallel_3d.py's gpt): the logits are my vocabulary
    columns, gathered over it for the comparison only."""
    def step(x, y):
        outputs = {}
        if grads is not None:
            grads.zero_grad()
        with runner.keys.training(0):
            loss = forward_backward(runner, actions, x, y, m, first_sample=replica[0] * len(x), outputs=outputs,
                                    grads=grads, loss_fn=loss_fn)
        if shards is not None:
            shards.release()
        if sum_first is not None:
            sum_first()
        if grads is not None:
            grads.final_late()
            grads.wait()
        if not outputs:
            return None, None
        logits = torch.cat([outputs[i] for i in range(m)]).detach()
        if vocab_group is not None:
            logits = gather_from_tp_region(logits, vocab_group, [logits.shape[-1]] * tp_size(vocab_group))
        return logits, loss
    return step


def pipeline_check(env, args, model, runner, data, forward_backward, replica=(0, 1), grads=None, sum_first=None,
                   optimizer=None, vocab_group=None):
    """--check for a pipeline program (mp.check): check_step on the first batch against the full model.
    optimizer (--zero): mp.zero's, whose slices are compared; their squares summed over its group too. The
    loss (mp.loss): the full model's of the whole batch; my replica's, of its slice, over the global count.
    vocab_group (parallel_3d.py's gpt): its tp group, over which the last stage's logits are split by
    vocabulary (mp.tp.vocab's loss; the logits gathered for the comparison)."""
    x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
    actions = schedule_actions(args.schedule, runner.pos, args.microbatches,
                               sends_at_once=runner.messenger.sends_at_once)
    pieces = args.microbatches * replica[1]   # the equal pieces the step averages: microbatches x replicas
    vocab_group = vocab_group if args.model == "gpt" else None
    loss_fn = tp_loss_function(args, data, 0, vocab_group, pieces) if vocab_group else \
        loss_function(args, data, 0, pieces)
    step = check_step(runner, actions, args.microbatches, forward_backward, replica, grads, sum_first, loss_fn,
                      getattr(optimizer, "shards", None), vocab_group)
    groups = runner.norm_groups + ([optimizer.grads.group] if optimizer is not None else [])
    return check_and_exit(env, args, args.schedule, model, step, x, y, replica=replica,
                          norm=(groups, runner.counted), optimizer=optimizer, loss_fn=loss_function(args, data, 0),
                          piece_loss=loss_function(args, data, 0, replica[1]))
