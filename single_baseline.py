"""The single-process reference: plain SGD training that every parallel program must reproduce.

Same model, same weights (built from --seed), same global batches in the same order, same loss.
Each parallel program logs the per-step training loss of this program within 1e-4 (the equivalence
contract, docs/equivalence.md); each one's docstring lists what it adds to this file.

    python single_baseline.py --data synthetic --steps 300
    python single_baseline.py --model gpt --data synthetic --loss-mask prefix   # a causal language model
    python -m mp.tools.plot_curves logs/single_baseline.jsonl -o plots/baseline.png
"""
from mp.errors import stop_on_interrupt   # first: a Ctrl-C during the imports below says one line too
if __name__ == "__main__":
    stop_on_interrupt()      # Ctrl-C from here on: exit 130 with one line, no traceback (mp/errors.py)

import copy

import torch

from mp import checkpoint
from mp.cli import baseline_args
from mp.data import agree_on_data, load_data, to_device
from mp.dist import distributed
from mp.loop import Job, evaluate, train, whole_model_run
from mp.loss import loss_function
from mp.models import build_model
from mp.moe import moe_layers, plus_aux_loss
from mp.optim import make_optimizer

PROGRAM = "single_baseline"


def parse_args(argv=None):
    args = baseline_args(argv, __doc__)   # mp/cli.py: the flags and every check they allow, without torch
    checkpoint.validate(args)               # the checkpoint to resume from, if any: whole, and of this run
    return args


# ----------------------------------------------------------------------------- training


def train_step(model, optimizer, x, y, loss_fn, step=0, grad_norm=None):
    """One optimizer step on the whole global batch (the samples of step `step`, for the dropout
    masks). loss_fn(logits, y): the mean cross-entropy (the gpt: over the batch's valid tokens,
    mp/loss.py). grad_norm(params): the full model's gradient norm, clipping the gradients to
    --clip-grad-norm if set (None: neither). Returns (the loss before the update, that norm)."""
    optimizer.zero_grad(set_to_none=True)
    with model.dropout_keys.training(step):
        loss = plus_aux_loss(model, loss_fn(model(x), y))   # --experts: + the load-balancing loss
    loss.backward()
    norm = grad_norm(list(model.parameters())) if grad_norm else None
    optimizer.step()
    return loss.detach(), norm      # tensors: the loop reads them every --log-every steps


def delayed_train_step(model, stale, optimizer, x, y, loss_fn, step=0, grad_norm=None):
    """--delay 1, PipeDream-2BW's update in one process: W(t+1) = W(t) - lr * grad f_t(W(t-1)).
    stale holds W(t-1) (at step 0 the initial weights). The gradient of batch t is taken there and
    applied to the current weights, momentum as usual; then stale becomes W(t). Returns (batch t's
    loss at W(t-1), the norm of that gradient)."""
    stale.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    with stale.dropout_keys.training(step):
        loss = plus_aux_loss(stale, loss_fn(stale(x), y))
    loss.backward()
    for p, old in zip(model.parameters(), stale.parameters()):
        p.grad = old.grad
    norm = grad_norm(list(model.parameters())) if grad_norm else None
    stale.load_state_dict(model.state_dict())   # W(t), before the update makes W(t+1)
    optimizer.step()
    return loss.detach(), norm


def clip_grad_norm(max_norm):
    """The one-process norm and clipping: torch's own (None: measure, never clip); a tensor."""
    if max_norm is None:
        return lambda params: torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return lambda params: torch.nn.utils.clip_grad_norm_(params, max_norm)


def main(argv=None):
    args = parse_args(argv)
    data = load_data(args)
    with distributed(args) as env:
        data = agree_on_data(data, args, env)   # --data auto: the same data on every rank
        model = build_model(args).to(env.device)
        for layer in moe_layers(model):          # --experts: the batch statistics of each microbatch, as a
            layer.microbatches = args.microbatches   # pipeline's (1, the default: of the whole batch)
        optimizer = make_optimizer(model.parameters(), args)
        stale = copy.deepcopy(model) if args.delay else None   # --delay 1: W(t-1), W(0) at first
        # a checkpoint holds both weights under --delay 1 (saved as stale/...), one otherwise
        versions = [(name, p, old, p) for (name, p), old in zip(model.named_parameters(), stale.parameters())] \
            if stale else None
        grad_norm = clip_grad_norm(args.clip_grad_norm)

        def step(k):
            x, y = (to_device(t, env.device) for t in data.batch(k, args.batch_size))   # the whole global batch
            loss_fn = loss_function(args, data, k)   # one piece: the whole batch
            if stale is None:
                return train_step(model, optimizer, x, y, loss_fn, k, grad_norm)
            return delayed_train_step(model, stale, optimizer, x, y, loss_fn, k, grad_norm)

        train(args, env, Job(step, model, optimizer, checkpoint.layout_of(PROGRAM, env),
                             evaluate=lambda: evaluate(data, env.device, whole_model_run(model, env.device)),
                             versions=versions))


if __name__ == "__main__":
    main()
