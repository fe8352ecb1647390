"""--check for the pipeline programs: one step on the first batch against the full model in this
process, tensor by tensor (pipeline_microbatch.py, pipeline_dp_joint.py and parallel_3d.py share it)."""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from clipping import clip_global
from common import build_model, make_optimizer
from data import dp_slice


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
