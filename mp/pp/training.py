"""The pieces the three pipeline programs share around their own steps: this step's inputs and labels
where a stage reads them (stage_batch), and --check's step (check_step, pipeline_check). Each program
writes its training step out in its own file; these are plain functions it calls by name."""
import torch

from mp.check import check_and_exit
from mp.data import next_batch
from mp.pp.pipedream import pipedream_inputs
from mp.pp.schedules import schedule_actions


def stage_batch(data, step, args, runner, device, replica=(0, 1)):
    """(inputs, labels) of step `step` where this stage reads them (mp.data.next_batch): the first
    stage its inputs, drawn one microbatch at a time as their forwards read them; the last stage its
    labels; a middle stage nothing. replica = (dp_rank, dp_size): a data-parallel replica draws its
    slice only. 2bw's first stage also draws the next batch, whose first forwards run in this step."""
    x, y = next_batch(data, step, args, runner.pos, device, replica, stream=not runner.versions)
    if runner.versions and runner.pos.is_first_stage:
        x = pipedream_inputs(x, data, step, args, runner.pos, replica, device)
    return x, y


def check_step(runner, actions, m, forward_backward, replica=(0, 1), grads=None, sum_first=None):
    """--check's step (mp.check) for a pipeline: the program's forward_backward on the first batch (this
    replica's slice), keeping the logits, then the gradients synchronised as in training: sum_first()
    (parallel_3d.py's tensor-parallel sums), then the data-parallel buckets (grads)."""
    def step(x, y):
        outputs = {}
        if grads is not None:
            grads.zero_grad()
        with runner.keys.training(0):
            loss = forward_backward(runner, actions, x, y, m, first_sample=replica[0] * len(x), outputs=outputs,
                                    grads=grads)
        if sum_first is not None:
            sum_first()
        if grads is not None:
            grads.final_late()
            grads.wait()
        return (torch.cat([outputs[i] for i in range(m)]), loss) if outputs else (None, None)
    return step


def pipeline_check(env, args, model, runner, data, forward_backward, replica=(0, 1), grads=None, sum_first=None,
                   optimizer=None):
    """--check for a pipeline program (mp.check): check_step on the first batch against the full model.
    optimizer (--zero): mp.zero's, whose slices are compared; their squares summed over its group too."""
    x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
    actions = schedule_actions(args.schedule, runner.pos, args.microbatches,
                               sends_at_once=runner.messenger.sends_at_once)
    step = check_step(runner, actions, args.microbatches, forward_backward, replica, grads, sum_first)
    groups = runner.norm_groups + ([optimizer.grads.group] if optimizer is not None else [])
    return check_and_exit(env, args, args.schedule, model, step, x, y, replica=replica,
                          norm=(groups, runner.counted), optimizer=optimizer)
