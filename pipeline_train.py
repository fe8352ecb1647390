"""The pipeline programs' training loop, shared by pipeline_microbatch.py, pipeline_dp_joint.py and
parallel_3d.py: each step draws its batch, runs pipeline_microbatch.train_step (the lesson's step)
on the schedule, lets the data-parallel replicas average their gradients (replicas: OneReplica for
a single pipeline), clips by the global norm, updates, then logs, evaluates, records the timeline
and saves checkpoints as every program does."""
import time

import torch.distributed as dist

import checkpoint
from clipping import clip_global
from common import (MetricsLog, Progress, awaiting, check_finite, clock, make_optimizer, memory_fields,
                    start_memory_count)
from data import next_batch
from pipedream import pipedream_inputs
from pipeline_eval import evaluate
from pipeline_microbatch import PROGRAM, train_step
from timeline import gather_timeline, timeline_steps, write_timeline


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
    """The training loop. actions: one step's action list, or step -> its list (2bw)."""
    optimizer = make_optimizer(runner.parameters(), args)
    layout = checkpoint.layout_of(program, env, dp=replicas.dp_size, pp=pos.pp_size,
                                  tp=env.world_size // (replicas.dp_size * pos.pp_size), schedule=args.schedule,
                                  virtual_stages=pos.virtual)
    first, written_by = checkpoint.resume(args, runner.model, optimizer, env.rank, runner.checkpoint_weights())
    # the rank that owns the loss; with tensor parallelism (parallel_3d.py), tp rank 0 of those
    owner = pos.is_last_stage and replicas.dp_rank == 0 and getattr(replicas, "tp_rank", 0) == 0
    log = MetricsLog(args.log_file, enabled=owner, resuming=first > 0)
    log.begin(program, args, env, first, written_by)
    progress = Progress(args.steps, enabled=owner)
    start_memory_count(env.device)
    recorded = timeline_steps(args)
    for step in range(first, args.steps):
        if args.timeline and step == recorded[0]:
            dist.barrier()                    # one clock for the timeline: everyone starts together
            runner.events, runner.origin = [], time.perf_counter()
        start = time.perf_counter()           # as in every program: from the batch's drawing on
        runner.record("step", f"step {step}", None, start)   # a mark, while the timeline records
        x, y = next_batch(data, step, args, pos, replicas, env.device, stream=not runner.versions)
        if runner.versions and pos.is_first_stage:   # 2bw's first stage also starts the next batch
            x = pipedream_inputs(x, data, step, args, pos, replicas, env.device)
        optimizer.zero_grad(set_to_none=True)
        samples, params = args.batch_size // replicas.dp_size, runner.parameters()
        with runner.keys.training(step):
            loss = train_step(runner, actions(step) if callable(actions) else actions, x, y, args.microbatches,
                              samples, replicas.dp_rank * samples)
        replicas.sync_grads(params)           # after the last backward, before the update
        with awaiting(f"rank {env.rank} waited for the gradient norm's sums of step {step}", args.timeout_s):
            norm = clip_global(params, args.clip_grad_norm, runner.norm_groups, runner.counted)
        runner.update(optimizer)
        loss = loss.item() if loss is not None else None   # read after the update, as the baseline does
        # the optimizer step's kernels included; on a GPU the step's one (bounded) CPU wait
        step_time = clock(env.device, args.timeout_s, lambda: f"step {step} (last exchange: {runner.messenger.last})") - start
        if runner.events is not None and step == recorded[-1]:
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
        checkpoint.maybe_save(args, step, runner.model, optimizer, layout, env.rank, runner.checkpoint_weights())
    log.write("summary", steps=args.steps, median_step_time_s=progress.median_step_time(),
              **memory_fields(env, runner.versions.held() if runner.versions else runner.parameters(),
                              runner.model_param_mb), schedule=args.schedule,
              microbatches=args.microbatches)
    log.close()
    return 0
