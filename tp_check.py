"""What tensor_parallel.py checks: its flags before any collective, one step against the full model
(--check), and the replicated parameters at the end of every run.

The flags: every rank needs whole heads and at least one neuron of each split layer, and under
--sequence-parallel an equal run of the vit's tokens; a bad value is one `error:` line, exit 2.
--check runs one step on the first batch with the parallel model and with the full model in this
process, and compares the output, the loss, every local gradient (against the matching slice of
the full model's) and every weight after one optimizer step. The report at the end of every run
checks that the tensors every tensor-parallel rank holds whole are still bit-identical.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from clipping import clip_global
from common import awaiting, build_model, fail, make_optimizer, replicas_identical
from tp_collectives import tp_size
from tp_replicas import counted_once, full_slice, replicated_parameters
from tp_sequence import VIT_TOKENS

# ----------------------------------------------------------------------------- the flags


def ranks_for(degree):
    return f"{degree} ranks (torchrun --nproc-per-node {degree})"


def validate_degree(args, degree, use_degree=ranks_for):
    """Every rank needs whole heads and at least one neuron of the narrowest split layer.
    use_degree(d): how to ask for degree d (here the world size; parallel_3d.py: --tp d)."""
    if args.model == "vit" and args.heads % degree:   # fixes that also keep --hidden divisible by --heads
        heads = [h for h in range(degree, args.hidden + 1, degree) if args.hidden % h == 0][:2]
        ranks = [d for d in range(2, args.heads + 1) if args.heads % d == 0][:1]
        fixes = [f"--heads {h}" for h in heads] + [use_degree(d) for d in ranks]
        fixes = fixes or [f"--hidden {args.hidden * degree} --heads {degree}"]
        fail(f"--heads {args.heads} is not divisible by the tensor-parallel degree {degree}; each rank "
             f"needs whole heads: use {' or '.join(fixes)}")
    if args.model == "cnn":
        width, what = 6, "output channels of cnn conv1"
    elif args.model == "mlp" and args.layers % 2:  # the classifier is split too: 10 outputs
        width, what = min(args.hidden, 10), "neurons of the mlp's narrowest split layer"
    else:
        width, what = args.hidden, f"--hidden neurons of the {args.model}"
    if degree > width:
        fail(f"the tensor-parallel degree {degree} exceeds the {width} {what}; every rank needs at least one: "
             f"use at most {use_degree(width)}")


def validate_sequence_parallel(args, degree, use_degree=ranks_for):
    """--sequence-parallel: the vit only, and every rank holds an equal run of its 64 tokens.
    use_degree(d): how to ask for degree d (here the world size; parallel_3d.py: --tp d)."""
    if getattr(args, "hybrid", False):   # parallel_3d.py has no --hybrid
        fail("--sequence-parallel shards the vit's tokens and --hybrid the cnn's batch; they do not combine: "
             "drop one of them")
    if args.model != "vit":
        fail(f"--sequence-parallel shards the vit's sequence of {VIT_TOKENS} tokens, and --model {args.model} "
             f"has no sequence: use --model vit, or drop --sequence-parallel")
    if VIT_TOKENS % degree:
        fits = [d for d in range(2, VIT_TOKENS + 1) if VIT_TOKENS % d == 0]
        near = [max(d for d in fits if d < degree)] + [d for d in fits if d > degree][:1]
        fail(f"the vit's {VIT_TOKENS} tokens are not divisible by the tensor-parallel degree {degree}; under "
             f"--sequence-parallel every rank holds an equal run of tokens: use {' or '.join(map(use_degree, near))}, "
             f"or drop --sequence-parallel")


# ----------------------------------------------------------------------------- --check


def compare(what, got, want, results):
    """Record (what, largest difference, error message or None) for one tensor."""
    diff = (got.detach() - want.detach()).abs().max().item() if got.numel() else 0.0
    try:
        torch.testing.assert_close(got, want)
        results.append((what, diff, None))
    except AssertionError as e:
        results.append((what, diff, " ".join(str(e).split())[:200]))


def check_one_step(model, reference, x, y, args, group=None):
    """One SGD step of the parallel model and of the full reference on (x, y), compared tensor by
    tensor: step 0's dropout masks, the gradients after clipping to the full model's norm."""
    results = []
    opt, ref_opt = make_optimizer(model.parameters(), args), make_optimizer(reference.parameters(), args)
    with model.dropout_keys.training(0), reference.dropout_keys.training(0):
        out, ref_out = model(x), reference(x)
    compare("output", out, ref_out, results)
    loss, ref_loss = F.cross_entropy(out, y), F.cross_entropy(ref_out, y)
    compare("loss", loss, ref_loss, results)
    loss.backward()
    ref_loss.backward()
    clip_global(model.parameters(), args.clip_grad_norm, [group], counted_once(model, group))
    torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip_grad_norm or float("inf"))
    for name, p in model.named_parameters():
        compare(f"gradient of {name}", p.grad, full_slice(model, name, reference.get_parameter(name).grad), results)
    opt.step()
    ref_opt.step()
    for name, p in model.named_parameters():
        compare(f"{name} after one step", p, full_slice(model, name, reference.get_parameter(name)), results)
    return results


def run_check(model, args, data, env, group):
    """--check: every rank compares its shards; all ranks agree on the exit status (0 match, 1 mismatch)."""
    x, y = (t.to(env.device) for t in data.batch(0, args.batch_size))
    results = check_one_step(model, build_model(args).to(env.device), x, y, args, group)
    for what, diff, error in results:
        if error:
            print(f"mismatch on rank {env.rank}: {what}: largest difference {diff:.3g}; {error}", flush=True)
    mine = torch.tensor([sum(e is not None for _, _, e in results), max(d for _, d, _ in results)],
                        dtype=torch.float64, device=env.device)
    if env.world_size > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    failed, worst = int(mine[0].item()), mine[1].item()
    if env.rank == 0:
        grads = sum(what.startswith("gradient") for what, _, _ in results)
        print(f"--check at degree {env.world_size}, model {args.model}: compared the output, the loss, {grads} "
              f"local gradients and {grads} weights after one step with the matching slices of the full model; "
              f"largest difference {worst:.3g}: {'MISMATCH' if failed else 'match'}", flush=True)
    return 1 if failed else 0


def report_replicas(model, group, env, timeout_s):
    """End of a run: the replicated parameters must be bit-identical on every tp rank. 0 if so, else 1."""
    with awaiting(f"rank {env.rank} waited to compare the replicated parameters", timeout_s):
        same = replicas_identical(replicated_parameters(model), group, env.device)
    if env.rank == 0:
        print(f"replicated parameters bit-identical across the {tp_size(group)} tensor-parallel ranks: "
              f"{'yes' if same else 'NO'}", flush=True)
    return 0 if same else 1
