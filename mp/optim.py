"""The optimizer every program builds over the parameters it holds, and what a checkpoint asks of it.

SGD with momentum keeps one tensor per parameter (its momentum buffer); AdamW keeps two, the running
mean of the gradient (exp_avg) and of its square (exp_avg_sq), and a step count for the bias
correction. Both update each element from that element's own gradient and state, so a rank that
holds a slice of a weight updates it exactly as the full model would: the optimizer needs no
communication in any layout (docs/optimizers.md).

Checkpoints (mp/checkpoint.py) write the state one parameter at a time through `param_state`, in the
parameter's own shape, and a resume reads into the tensors it gives, made first by `make_state`. An
optimizer that keeps its state elsewhere defines methods of the same names and is asked through them
instead (mp.zero's, which holds only its replica's share, defines make_state, and saved_pieces in place of
param_state: it saves its slices as they are and a resume reads into them).
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
    """A context for a forward outside a step (the evaluation): every weight whole where a block uses it.
    --zero 3 gathers each block as its forward starts and frees it when it ends, a block at a time as a
    step does (mp.param_shards), so every replica must run the same forwards inside; otherwise the
    weights always are whole."""
    return optimizer.whole_params() if hasattr(optimizer, "whole_params") else contextlib.nullcontext()


def every_param_whole(optimizer):
    """A context in which every weight of the model is whole at once (what reads the parameters
    themselves, not through a forward: the end-of-run comparison of replicas): --zero 3 gathers them all
    for its duration; otherwise they always are."""
    return optimizer.every_param_whole() if hasattr(optimizer, "every_param_whole") else contextlib.nullcontext()


def counting(optimizer, phase):
    """A context whose gathered weights (--zero 3) count as this phase's peak, not a step's (mp.param_shards)."""
    return optimizer.counting(phase) if hasattr(optimizer, "counting") else contextlib.nullcontext()


def runs_on_every_replica(optimizer):
    """Whether a forward outside a step must run on every data-parallel replica, not on one (--zero 3:
    each block's all-gather takes every replica's slice)."""
    return getattr(optimizer, "gathers_by_block", False)


def make_state(optimizer, kinds_of):
    """Before a resume reads into them (mp.checkpoint): kinds_of [(p, kinds)], the state of these kinds
    ("momentum", "exp_avg", ...; "step") for each p, made as the optimizer's first step makes it (zeros; the
    step a float32 0-dim tensor on the CPU), in the optimizer's own state. --zero: of this replica's slices,
    every kind (mp.zero)."""
    if hasattr(optimizer, "make_state"):
        return optimizer.make_state(sorted({kind for _, kinds in kinds_of for kind in kinds}))
    for p, kinds in kinds_of:
        state = optimizer.state[p]
        for kind in kinds:
            state[TORCH_NAME.get(kind, kind)] = torch.zeros((), dtype=torch.float32) if kind == "step" else \
                torch.zeros_like(p, memory_format=torch.contiguous_format)


def loaded(optimizer):
    """After a resume read this rank's tensors: --zero 1, 2 all-gather the weights' slices (mp.zero)."""
    if hasattr(optimizer, "loaded"):
        optimizer.loaded()


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
