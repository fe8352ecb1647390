"""The optimizer every program builds over the parameters it holds, and what a checkpoint asks of it.

SGD with momentum keeps one tensor per parameter (its momentum buffer); AdamW keeps two, the running
mean of the gradient (exp_avg) and of its square (exp_avg_sq), and a step count for the bias
correction. Both update each element from that element's own gradient and state, so a rank that
holds a slice of a weight updates it exactly as the full model would: the optimizer needs no
communication in any layout (docs/optimizers.md).

Checkpoints (mp/checkpoint.py) read and write the state one parameter at a time through
`param_state` and `load_param_state`, in the parameter's own shape. An optimizer that keeps its state
elsewhere defines methods of the same names and is asked through them instead (mp.zero's, which holds
only its replica's share, defines load_param_state, and saved_pieces in place of param_state: it
saves its slices as they are).
"""
import contextlib

import torch

from mp.flags import DEFAULT_LR

KIND = {"momentum_buffer": "momentum"}       # torch's state names -> the checkpoint's (older checkpoints: momentum/)
TORCH_NAME = {kind: name for name, kind in KIND.items()}


def default_lr(optimizer):
    return DEFAULT_LR[optimizer]


def make_optimizer(params, args):
    """torch's SGD or AdamW, with torch's default implementation (foreach where the tensors allow it),
    never the fused kernel: one code path for the baseline and every layout. args without the
    optimizer flags (a benchmark's Namespace) means SGD; --lr None, the optimizer's default."""
    name = getattr(args, "optimizer", "sgd")
    lr = args.lr if getattr(args, "lr", None) is not None else default_lr(name)
    decay = getattr(args, "weight_decay", 0.0)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(args.beta1, args.beta2), eps=args.adam_eps,
                                 weight_decay=decay, fused=False)
    raise ValueError(f"unknown optimizer {name!r}")   # flags.py refuses it first, with one error line


def param_state(optimizer, p):
    """{kind: tensor} of p's state on this rank: tensors shaped like p ("momentum" for SGD, "exp_avg" and
    "exp_avg_sq" for AdamW) and, where the optimizer counts steps, "step", a 0-dim tensor. Empty before
    the first step (and where another rank holds p's state). The tensors are the optimizer's own."""
    if hasattr(optimizer, "param_state"):
        return optimizer.param_state(p)
    return {KIND.get(name, name): value for name, value in optimizer.state.get(p, {}).items()
            if torch.is_tensor(value)}      # SGD with --momentum 0 keeps momentum_buffer = None: nothing to save


def whole_params(optimizer):
    """A context in which every weight of the model is whole: --zero 3 gathers them for its duration
    (mp.param_shards); otherwise they always are."""
    return optimizer.whole_params() if hasattr(optimizer, "whole_params") else contextlib.nullcontext()


def load_param_state(optimizer, p, state):
    """Set p's state from {kind: tensor} as param_state gives it (copies are kept, never the tensors
    given). The step stays a float32 tensor on the CPU, where torch's AdamW keeps it (not capturable)."""
    if hasattr(optimizer, "load_param_state"):
        return optimizer.load_param_state(p, state)
    mine = optimizer.state[p]
    for kind, value in state.items():
        if kind == "step":
            mine["step"] = value.detach().to("cpu", torch.float32).clone()
        else:
            mine[TORCH_NAME.get(kind, kind)] = value.detach().to(p.device, p.dtype).clone()


def grad_mb(params, optimizer):
    """MB of the gradients this rank holds after a step's backward and update (the summary's grad_mb):
    the .grad of the model's parameters and of the optimizer's own (--zero's slices), each storage
    counted once, so gradients that are views into a flat bucket count as the bucket, padding included.
    --zero 2 lets the whole buckets go, so only the slices are left."""
    storages = {}
    for p in list(params) + [q for group in optimizer.param_groups for q in group["params"]]:
        if p.grad is not None:
            storage = p.grad.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


def optimizer_state_mb(optimizer):
    """MB (2**20 bytes) of the state tensors this rank holds: twice param_mb for AdamW, once for SGD."""
    if hasattr(optimizer, "state_mb"):
        return optimizer.state_mb()
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v)) / 2**20
