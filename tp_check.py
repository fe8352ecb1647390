"""tensor_parallel.py --check, and the end-of-run report on the replicated parameters.

--check runs one step on the first batch with the parallel model and with the full model in this
process, and compares the output, the loss, every local gradient (against the matching slice of
the full model's) and every weight after one optimizer step. The report at the end of every run
checks that the tensors every tensor-parallel rank holds whole are still bit-identical.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from clipping import clip_global
from common import awaiting, build_model, make_optimizer, replicas_identical
from tensor_parallel import counted_once, full_slice, replicated_parameters, tp_size


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
