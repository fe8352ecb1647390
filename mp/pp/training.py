"""What the three pipeline programs hand the training loop (mp.loop) and --check (mp.check): one
step of a pipeline around the lesson's train_step (pipeline_microbatch.py, passed in), and the
data-parallel hooks of a single pipeline (OneReplica; pipeline_dp_joint.py has D replicas)."""
import time

import torch

from mp import checkpoint
from mp.check import check_and_exit
from mp.clipping import clip_global, finish_norms
from mp.data import next_batch
from mp.dist import awaiting
from mp.loop import Job
from mp.optim import make_optimizer
from mp.pp.evaluate import evaluate_pipeline
from mp.pp.pipedream import pipedream_inputs
from mp.pp.schedules import schedule_actions
from mp.pp.timeline import Timeline


class OneReplica:
    """Data parallelism's hooks, for a single pipeline: the whole batch, nothing to average.
    pipeline_dp_joint.py passes its own, with D replicas and a process group."""
    dp_rank, dp_size, tp_rank = 0, 1, 0

    def slice(self, tensor):
        return tensor

    def zero_grad(self, optimizer):           # optimizer None: --check, before any gradient exists
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)

    def sync_grads(self, params):
        pass

    def clip(self, params, max_norm, groups, counted):
        return clip_global(params, max_norm, groups, counted)

    def norm_groups(self, groups):
        return groups

    def average(self, losses):
        return losses

    def make_optimizer(self, params, args):
        return make_optimizer(params, args)


def pipeline_job(args, env, pos, model, runner, data, train_step, replicas=OneReplica(), program="pipeline_microbatch"):
    """The training loop's Job for a pipeline (mp.loop): each step draws its batch, runs the lesson's
    train_step (pipeline_microbatch.py) on the schedule, lets the data-parallel replicas average
    their gradients, clips by the global norm and updates. Nothing is read back from the device: the
    loss and the norm stay tensors (mp.loop reads them every --log-every steps, after finish() has
    averaged the losses over the replicas and summed the norms over the ranks, once for all those
    steps). The loss is logged by the last stage of replica 0 (its tp rank 0)."""
    actions = runner.versions.step_actions(args.steps) if runner.versions else \
        schedule_actions(args.schedule, pos, args.microbatches)   # 2bw: its first step warms up, its last drains
    owner = pos.is_last_stage and replicas.dp_rank == 0 and replicas.tp_rank == 0
    timeline, samples = Timeline(args, runner, pos, owner), args.batch_size // replicas.dp_size
    clipped, norm_groups = args.clip_grad_norm is not None, replicas.norm_groups(runner.norm_groups)

    def step(k, optimizer):
        timeline.begin(k)
        runner.record("step", f"step {k}", None, time.perf_counter())   # a mark, while the timeline records
        x, y = next_batch(data, k, args, pos, replicas, env.device, stream=not runner.versions)
        if runner.versions and pos.is_first_stage:   # 2bw's first stage also starts the next batch
            x = pipedream_inputs(x, data, k, args, pos, replicas, env.device)
        replicas.zero_grad(optimizer)
        with runner.keys.training(k):
            loss = train_step(runner, actions(k) if callable(actions) else actions, x, y, args.microbatches,
                              samples, replicas.dp_rank * samples)
        params = runner.parameters()
        replicas.sync_grads(params)           # after the last backward, before the update
        with awaiting(f"rank {env.rank} waited for the gradient norm's sums of step {k}", args.timeout_s):
            norm = replicas.clip(params, args.clip_grad_norm, runner.norm_groups, runner.counted)
        runner.update(optimizer)
        return (loss.detach() if loss is not None else None), norm

    def finish(losses, norms):                # every --log-every steps, on every rank
        with awaiting(f"rank {env.rank} waited for the logged losses' and norms' sums", args.timeout_s):
            return (replicas.average(losses) if losses is not None else None), \
                finish_norms(norms, norm_groups, clipped)

    layout = dict(dp=replicas.dp_size, pp=pos.pp_size, tp=env.world_size // (replicas.dp_size * pos.pp_size),
                  schedule=args.schedule, virtual_stages=pos.virtual)
    return Job(program, model, step, runner.parameters(), checkpoint.layout_of(program, env, **layout), owner,
               evaluate=lambda: evaluate_pipeline(runner, pos, data, env.device) if replicas.dp_rank == 0 else None,
               versions=lambda: runner.versions.weights(model) if runner.versions else None,
               held=runner.versions.held if runner.versions else None,
               summary=dict(schedule=args.schedule, microbatches=args.microbatches),
               awaited=lambda k: f"step {k} (last exchange: {runner.messenger.last})", after_step=timeline.end,
               finish=finish, optimizer=replicas.make_optimizer)


def pipeline_check(env, args, model, runner, data, train_step, replicas=OneReplica(), reference=None):
    """--check for a pipeline program (mp.check): the lesson's train_step on the first batch, keeping
    the logits, with the gradients synchronised over the replicas as in training."""
    x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
    step = check_step(runner, schedule_actions(args.schedule, runner.pos, args.microbatches), args.microbatches,
                      train_step, replicas)
    return check_and_exit(env, args, args.schedule, model, step, x, y, replica=(replicas.dp_rank, replicas.dp_size),
                          norm=(runner.norm_groups, runner.counted), reference=reference)


def check_step(runner, actions, m, train_step, replicas=OneReplica()):
    """--check's step (mp.check): the lesson's train_step on the first batch, keeping the logits; gradients
    synchronised over the replicas as in training."""
    def step(x, y):
        outputs = {}
        replicas.zero_grad(None)
        with runner.keys.training(0):
            loss = train_step(runner, actions, x, y, m, first_sample=replicas.dp_rank * len(x), outputs=outputs)
        replicas.sync_grads(runner.parameters())
        return (torch.cat([outputs[i] for i in range(m)]), loss) if outputs else (None, None)
    return step
