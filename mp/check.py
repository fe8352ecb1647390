"""--check, for every parallel program, and the end-of-run report on replicas.

--check runs one step on the first batch twice: with this rank's part of the model (the program's own
forward and backward) and with the full model in this process. It compares, with
torch.testing.assert_close, the output and the loss where this rank has them, every local gradient
(against the matching slice of the full model's, after clipping to the full model's norm) and every
weight after one optimizer step, prints what it compared and the largest difference, and exits 0 on a
match and 1 on a mismatch, naming the tensor and the rank.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp.clipping import clip_global
from mp.data import dp_slice
from mp.dist import awaiting, replicas_identical
from mp.models import build_model, full_slice
from mp.moe import moe_layers, plus_aux_loss
from mp.optim import make_optimizer


def compare(what, got, want, results):
    """Record (what, largest difference, error message or None) for one tensor."""
    diff = (got.detach() - want.detach()).abs().max().item() if got.numel() else 0.0
    try:
        torch.testing.assert_close(got, want)
        results.append((what, diff, None))
    except AssertionError as e:
        results.append((what, diff, " ".join(str(e).split())[:200]))


def whole_model_step(model, loss_fn=F.cross_entropy):
    """check_one_step's step for a model that takes the whole batch (tensor parallelism); loss_fn: the
    batch's loss (mp.loss.loss_function)."""
    def step(x, y):
        with model.dropout_keys.training(0):      # step 0's masks, as in training
            logits = model(x)
        loss = loss_fn(logits, y)
        loss.backward()
        return logits, loss
    return step


def check_one_step(args, model, step, x, y, replica=(0, 1), norm=((), None), reference=None, samples=None,
                   optimizer=None, loss_fn=F.cross_entropy, piece_loss=None):
    """step(x, y) -> (logits, loss), or (None, None) where this rank has neither: the program's forward
    and backward of one batch on this rank's part of the model, with step 0's dropout masks and every
    gradient synchronised as its training step does (None: whole_model_step). replica = (dp_rank, dp):
    with data parallelism this rank runs, and is compared on, its slice of the batch; samples (a tensor
    of the batch's indices, in the order my step runs them) where my samples are not one slice
    (parallel_5d.py: a part of every microbatch). norm: the gradient norm's groups and counted()
    (mp.clipping). reference: the full model (None: built here). optimizer (--zero): the program's own
    (mp.zero), whose slices are compared instead of whole gradients, which no replica ever assembles.
    loss_fn: the whole batch's loss (mp.loss.loss_function: the gpt's over the batch's valid tokens);
    piece_loss: what my step's loss is of my samples (default: loss_fn of them).
    Returns [(what, largest difference, error or None)], one per tensor."""
    reference = build_model(args).to(x.device) if reference is None else reference   # the full model: --check only
    for layer in moe_layers(reference):   # --experts: each microbatch routed on its own, as single_baseline.py
        layer.microbatches = getattr(args, "microbatches", 1)   # --microbatches M and the pipeline route it
    with reference.dropout_keys.training(0):
        ref_logits = reference(x)
    plus_aux_loss(reference, loss_fn(ref_logits, y)).backward()   # --experts: + the load-balancing loss
    torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip_grad_norm or float("inf"))
    make_optimizer(reference.parameters(), args).step()
    if samples is None:                   # a replica's samples are one slice of the batch
        samples = dp_slice(torch.arange(len(y)), *replica)
    x, y, ref_logits = (t[samples.to(t.device)] for t in (x, y, ref_logits.detach()))
    results = []
    logits, loss = (step or whole_model_step(model))(x, y)
    if logits is not None:
        compare("output", logits.detach(), ref_logits, results)
        compare("loss", loss.detach(), (piece_loss or loss_fn)(ref_logits, y), results)
    ref = dict(reference.named_parameters())
    if optimizer is not None:
        return results + compare_slices(args, model, optimizer, norm, ref)
    local = list(model.named_parameters())
    clip_global([p for _, p in local], args.clip_grad_norm, *norm)
    for name, p in local:
        compare(f"gradient of {name}", p.grad, full_slice(model, name, ref[name].grad), results)
    make_optimizer([p for _, p in local], args).step()
    for name, p in local:
        compare(f"weight of {name} after one step", p.detach(), full_slice(model, name, ref[name].detach()), results)
    return results


def compare_slices(args, model, optimizer, norm, ref):
    """--zero: each replica holds the mean gradient of its slice of every bucket only, and steps that slice; so
    compare each piece of a parameter in my slices (its gradient, clipped as the program clips, then its weight
    after the program's own optimizer's step) with the same flat range of the full model's."""
    groups, counted = norm
    clip_global(optimizer.slices, args.clip_grad_norm, groups, squares=optimizer.squares(counted))
    names, results = {id(p): name for name, p in model.named_parameters()}, []
    pieces = [(mine, names[id(p)], start, first, n)
              for part in getattr(optimizer, "parts", [optimizer])          # ZeroPair: the dense and the experts'
              for b, mine in zip(part.grads.buckets, part.slices) for p, start, first, n in b.segments(part.grads.rank)]
    for mine, name, start, first, n in pieces:
        want = full_slice(model, name, ref[name].grad).reshape(-1)[first:first + n]
        compare(f"gradient of {name} (my slice)", mine.grad[start:start + n], want, results)
    optimizer.step()
    for mine, name, start, first, n in pieces:
        want = full_slice(model, name, ref[name].detach()).reshape(-1)[first:first + n]
        compare(f"weight of {name} after one step (my slice)", mine.detach()[start:start + n], want, results)
    return results


def check_and_exit(env, args, what, model, step, x, y, **options):
    """--check on every rank (check_one_step's arguments); rank 0 prints each mismatch, naming its rank,
    and one summary line (what: the layout checked); all ranks agree on the exit status (0 match, 1 mismatch)."""
    results = check_one_step(args, model, step, x, y, **options)
    errors = [f"{name} differs (largest difference {diff:.3g}): {error}" for name, diff, error in results if error]
    grads = sum(name.startswith("gradient") for name, _, _ in results)
    every = [None] * env.world_size
    with awaiting(f"rank {env.rank} waited for every rank's --check results", args.timeout_s):
        dist.all_gather_object(every, (len(results), max((d for _, d, _ in results), default=0.0), grads, errors[:1]))
    if env.rank == 0:
        for rank, (_, _, _, error) in enumerate(every):
            if error:
                print(f"check: rank {rank}: MISMATCH: {error[0]}", file=sys.stderr, flush=True)
        bad, ranks = sum(bool(error) for *_, error in every), f"{env.world_size} rank{'s' * (env.world_size > 1)}"
        verdict = f"MISMATCH on {bad} rank(s)" if bad else "all tensors match the full model"
        print(f"--check, {what} on {ranks}, model {args.model}: {sum(e[0] for e in every)} tensors compared with the "
              f"full model (the output and the loss where a rank has them; rank 0: {every[0][2]} local gradients "
              f"and {every[0][2]} weights after one step); largest difference {max(e[1] for e in every):.2e}: "
              f"{verdict}", flush=True)
    return 1 if any(error for *_, error in every) else 0


def report_replicas(params, group, what, env, timeout_s, zero=0, uneven=False):
    """End of a run: the tensors that several ranks hold (data-parallel replicas of a stage, tensors
    every tensor-parallel rank holds whole) must be bit-identical across `group`: same start, same
    gradient, same update. what: the claim rank 0 prints, answered yes or NO. Returns 0 if so, else 1.
    zero (--zero 1-3 on a data-parallel group): each replica's weights are all-gathered from the slices
    the replicas updated, the same bytes everywhere whatever the update did, so a yes could not be a
    no: nothing is compared, and the line says so (the check is the baseline's losses, tests/test_zero.py).
    A group of one rank (--dp 1, --tp 1) holds its tensors alone: nothing to compare, and no line. uneven: the
    groups of this name differ in size (a pipeline's embedding group: the first and last stage, each middle
    stage alone), so a rank alone still joins the verdict's world-wide collective."""
    if dist.get_world_size(group) == 1 and not uneven:
        return 0
    if zero:
        if env.rank == 0:
            print(f"{what}: not compared, the same bytes by construction (--zero {zero} all-gathers every "
                  f"replica's updated slice)", flush=True)
        return 0
    with awaiting(f"rank {env.rank} waited to compare the replicas ({what})", timeout_s):
        same = replicas_identical(params, group, env.device, timeout_s)
    if env.rank == 0:
        print(f"{what}: {'yes' if same else 'NO'}", flush=True)
    return 0 if same else 1
