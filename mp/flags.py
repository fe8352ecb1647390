"""The flags every program shares and their checks, run right after parsing, before any collective
(each lesson adds its own flags on top of base_parser)."""
import argparse
import copy
import math
import os
import sys

from mp import checkpoint
from mp.errors import fail
from mp.models import ACTIVATIONS


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default after its help."""

    def _format_action(self, action):
        if action.option_strings and not any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            action = copy.copy(action)
            help_ = action.help or ""
            if "%(default)" not in help_:
                action.help = f"{help_} (default: %(default)s)".lstrip()
        return super()._format_action(action)


# the model flags each model reads: a flag given for a model that ignores it is refused, not dropped
MODEL_FLAGS = {"cnn": (), "mlp": ("--layers", "--hidden"), "vit": ("--layers", "--hidden", "--heads")}


class Parser(argparse.ArgumentParser):
    """argparse with one `error:` line, no abbreviations (--layer is not --layers, and no flag can
    pass for one of torchrun's), and the model flags checked against the model."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):  # argparse's own mistakes get the same one-line form
        fail(f"{message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        parsed = super().parse_args(argv, namespace)
        given = [a.split("=")[0] for a in argv if a.split("=")[0] in MODEL_FLAGS["vit"]]
        unused = [flag for flag in dict.fromkeys(given) if flag not in MODEL_FLAGS[parsed.model]]
        if unused:
            used = ", ".join(MODEL_FLAGS[parsed.model]) or "none of --layers, --hidden, --heads"
            fail(f"--model {parsed.model} does not use {', '.join(unused)} (it reads {used}): "
                 f"drop {'them' if len(unused) > 1 else 'it'}, or choose a model that does")
        return parsed


def base_parser(description):
    p = Parser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--model", choices=["cnn", "mlp", "vit"], default="cnn")
    p.add_argument("--layers", type=int, default=4, help="mlp: Linear layers; vit: blocks (the cnn has 5 fixed blocks)")
    p.add_argument("--hidden", type=int, default=128, help="mlp: width; vit: embedding width")
    p.add_argument("--heads", type=int, default=4, help="vit: attention heads")
    p.add_argument("--activation", choices=ACTIVATIONS, default="gelu",
                   help="every model's activation; relu: --model mlp --layers 2 is the course's Linear-ReLU-Linear "
                        "(its kinks let float32 rounding differences grow: docs/equivalence.md)")
    p.add_argument("--data", choices=["auto", "cifar10", "synthetic"], default="auto",
                   help="auto: CIFAR-10 if it is in --data-dir or can be downloaded, else synthetic")
    p.add_argument("--data-dir", default="./data", help="where CIFAR-10 is, or is downloaded to once")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps, numbered from 0 on screen and in the log")
    p.add_argument("--batch-size", type=int, default=64, help="global batch of one optimizer step")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order")
    p.add_argument("--eval-every", type=int, default=50,
                   help="test loss/accuracy every K steps and after the last (0: never)")
    p.add_argument("--log-file", default=None, help="metrics log, JSON lines (default: logs/<program>.jsonl)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="auto: nccl with one GPU per local rank, else gloo")
    p.add_argument("--timeout-s", type=float, default=180.0, help="collective/p2p timeout in seconds")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout probability (mlp: after each hidden activation; vit: attention and MLP outputs; "
                        "cnn: before fc1 and fc2), with masks that every layout draws alike")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip the gradient to this global norm (the full model's; default: no clipping)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save checkpoints here (torch.distributed.checkpoint, in the baseline model's coordinates); "
                        "a run whose directory holds one resumes from the latest, in any layout")
    p.add_argument("--save-every", type=int, default=50,
                   help="with --checkpoint-dir: save every K steps and after the last")
    return p


def validate_common(args, program):
    """Checks every program shares; called right after parsing, before any collective."""
    for name in ("steps", "batch_size", "layers", "hidden", "heads", "threads"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be a positive integer")
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every} must be >= 0 (0 turns evaluation off)")
    for name in ("lr", "momentum", "timeout_s"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (value == 0 and name != "momentum"):
            fail(f"--{name.replace('_', '-')} {value} must be a finite number > 0"
                 + (" (or 0 for momentum)" if name == "momentum" else ""))
    if not 0 <= args.dropout < 1:
        fail(f"--dropout {args.dropout} must be a probability in [0, 1), e.g. 0.1")
    if args.clip_grad_norm is not None and not (math.isfinite(args.clip_grad_norm) and args.clip_grad_norm > 0):
        fail(f"--clip-grad-norm {args.clip_grad_norm} must be a finite number > 0 (omit it for no clipping)")
    if args.model == "mlp" and args.layers < 2:
        fail(f"--layers {args.layers}: the mlp needs at least 2 Linear layers")
    if args.model == "vit" and args.hidden % args.heads:
        fail(f"--hidden {args.hidden} is not divisible by --heads {args.heads}; "
             f"choose --heads among the divisors of {args.hidden}")
    if args.log_file is None:
        args.log_file = os.path.join("logs", f"{program}.jsonl")
    checkpoint.validate(args)
