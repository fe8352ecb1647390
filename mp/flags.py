"""The flags every program shares and their checks, run right after parsing, before any collective
(each program's own flags are added on top of base_parser in mp/cli.py). No torch: the launchers
check every run's flags in one process before anything imports it (mp/tools/check_args.py)."""
import argparse
import copy
import difflib
import math
import os
import sys

from mp.ep.flags import add_expert_flags, validate_experts
from mp.errors import fail
from mp.sizes import ACTIVATION_NAMES

DEFAULT_LR = {"sgd": 0.02, "adamw": 1e-3}   # --lr when it is not given (mp.optim builds the optimizer)


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
EXPERT_FLAGS = ("--experts", "--top-k", "--aux-loss", "--capacity-factor")
MODEL_FLAGS = {"cnn": (), "mlp": ("--layers", "--hidden"),
               "vit": ("--layers", "--hidden", "--heads", "--patch-size") + EXPERT_FLAGS,
               "gpt": ("--layers", "--hidden", "--heads", "--seq-len", "--tie-embeddings", "--loss-mask",
                       "--text-file") + EXPERT_FLAGS}
ALL_MODEL_FLAGS = tuple(dict.fromkeys(f for flags in MODEL_FLAGS.values() for f in flags))
# the programs that train --model gpt so far (each axis's lesson joins as it learns the language model)
GPT_PROGRAMS = ("single_baseline", "pipeline_microbatch", "pipeline_dp_joint", "tensor_parallel", "context_parallel",
                "expert_parallel", "parallel_3d", "parallel_5d")


class OneLineParser(argparse.ArgumentParser):
    """argparse with one `error:` line and exit status 2 (mp.errors.fail), not its usage block, and no
    abbreviations (--layer is not --layers, and no flag can pass for one of torchrun's): what every
    script wants, the benchmarks included, whose parsers have no --model for Parser to check."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):  # argparse's own mistakes get the same one-line form
        fail(f"{message}{self.did_you_mean(message)} (see --help)")

    def did_you_mean(self, message):
        """For a mistyped flag (--hiden 64), the flags it is close to: ": did you mean --hidden?"."""
        if not message.startswith(UNRECOGNIZED):
            return ""
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        typed = [w.split("=")[0] for w in message.removeprefix(UNRECOGNIZED).split() if w.startswith("--")]
        near = [m for w in typed for m in difflib.get_close_matches(w, flags, n=1, cutoff=0.7)
                or [f for f in flags if f.startswith(w)][:1]]
        return f": did you mean {' and '.join(dict.fromkeys(near))}?" if near else ""


UNRECOGNIZED = "unrecognized arguments: "   # argparse's words for flags no parser took


class Parser(OneLineParser):
    """OneLineParser with the model flags checked against the model."""

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        parsed = super().parse_args(argv, namespace)
        given = [a.split("=")[0] for a in argv if a.split("=")[0] in ALL_MODEL_FLAGS]
        unused = [flag for flag in dict.fromkeys(given) if flag not in MODEL_FLAGS[parsed.model]]
        if unused:
            used = ", ".join(MODEL_FLAGS[parsed.model]) or "no model flag"
            fail(f"--model {parsed.model} does not use {', '.join(unused)} (it reads {used}): "
                 f"drop {'them' if len(unused) > 1 else 'it'}, or choose a model that does")
        return parsed


def base_parser(description):
    p = Parser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--model", choices=["cnn", "mlp", "vit", "gpt"], default="cnn",
                   help="cnn, mlp, vit: CIFAR-10 classifiers; gpt: a causal language model on bytes of text")
    p.add_argument("--layers", type=int, default=4,
                   help="mlp: Linear layers; vit, gpt: transformer blocks (the cnn has 5 fixed blocks)")
    p.add_argument("--hidden", type=int, default=128, help="mlp: width; vit, gpt: embedding width")
    p.add_argument("--heads", type=int, default=4, help="vit, gpt: attention heads")
    p.add_argument("--patch-size", type=int, default=4,
                   help="vit: the side of a square patch; (32/P)^2 tokens (4: 64, 2: 256, 1: 1024)")
    add_text_flags(p)                      # gpt: --seq-len, --tie-embeddings, --loss-mask, --text-file
    add_expert_flags(p)                    # vit, gpt: --experts, --top-k, --aux-loss, --capacity-factor (mp/ep)
    p.add_argument("--activation", choices=ACTIVATION_NAMES, default="gelu",
                   help="every model's activation; relu: --model mlp --layers 2 is the course's Linear-ReLU-Linear "
                        "(its kinks let float32 rounding differences grow: docs/equivalence.md)")
    p.add_argument("--data", choices=["auto", "cifar10", "shakespeare", "synthetic"], default="auto",
                   help="auto: CIFAR-10 (gpt: tiny Shakespeare, or --text-file) if it is in --data-dir or can be "
                        "downloaded, else synthetic; cifar10 for the image models, shakespeare for the gpt")
    p.add_argument("--data-dir", default="./data",
                   help="where CIFAR-10 and tiny Shakespeare are, or are downloaded to once")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps, numbered from 0 on screen and in the log")
    p.add_argument("--batch-size", type=int, default=64, help="global batch of one optimizer step")
    add_optimizer_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order")
    p.add_argument("--log-every", type=int, default=10,
                   help="the step's scalars (loss, grad norm) stay on the device and are read in one batch every K "
                        "steps and at the end; every step still lands in the log")
    p.add_argument("--eval-every", type=int, default=50,
                   help="test loss/accuracy every K steps and after the last (0: never)")
    p.add_argument("--log-file", default=None, help="metrics log, JSON lines (default: logs/<program>.jsonl)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="auto: nccl with a GPU per local rank (or shared, where NCCL allows: docs/gpu.md), else gloo")
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
    p.add_argument("--trace-collectives", action="store_true",
                   help="print every collective and point-to-point send of rank 0's first step, in the order it ran, "
                        "with its group, shape and bytes (mp/traffic.py)")
    return p


def add_text_flags(p):
    """The gpt's own flags (mp.text holds the data, mp.loss the loss they shape)."""
    p.add_argument("--seq-len", type=int, default=64, help="gpt: bytes a sample reads (its context window)")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="gpt: the output layer reuses the input embedding's weight (one parameter)")
    p.add_argument("--loss-mask", default="none", metavar="{none,prefix,prefix:N}",
                   help="gpt: prefix leaves a seeded prefix of each sample, 0 to N tokens long (default N: half "
                        "the sequence), out of the loss, so samples, microbatches and ranks hold different counts "
                        "of valid tokens (the loss: their sum over the global batch's count)")
    p.add_argument("--text-file", default=None,
                   help="gpt: train on this file's bytes (the last tenth held out for the evaluation)")


# the programs with a data-parallel axis, whose replicas can split the optimizer state (--zero 1)
ZERO_PROGRAMS = ("pipeline_dp_joint", "parallel_3d", "parallel_5d")


def add_optimizer_flags(p):
    lrs = ", ".join(f"{lr:g} for {name}" for name, lr in DEFAULT_LR.items())
    p.add_argument("--optimizer", choices=list(DEFAULT_LR), default="sgd",
                   help="sgd: SGD with momentum; adamw: AdamW (two state tensors per parameter: docs/optimizers.md)")
    p.add_argument("--lr", type=float, default=None, help=f"learning rate (default: {lrs})")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (AdamW ignores it)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="SGD: torch's L2 term added to the gradient; AdamW: its decoupled decay of the weights")
    p.add_argument("--beta1", type=float, default=0.9, help="AdamW's decay rate of the gradient's running mean")
    p.add_argument("--beta2", type=float, default=0.999,
                   help="AdamW's decay rate of the squared gradient's running mean")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's epsilon, added to the denominator")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="1: ZeRO-1, each data-parallel replica keeps the optimizer state of its 1/D slice of the "
                        "parameters only; 2: ZeRO-2, and between the backward and the next step only its 1/D of "
                        "the gradients; 3: ZeRO-3, and between uses only its 1/D of the weights, each block's "
                        "all-gathered before it runs (pipeline_dp_joint.py, parallel_3d.py)")
    p.add_argument("--zero3-gather", choices=["step", "microbatch"], default=None,
                   help="--zero 3: gather each block's weights once a step and keep them through every "
                        "microbatch (step, the default with several microbatches: fewer bytes), or before every "
                        "microbatch's forward and backward, freed after each (microbatch, the default with one: "
                        "less memory held)")


def add_bucket_flag(p):
    """--bucket-mb, in the programs whose data-parallel gradients go in buckets (mp.buckets)."""
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="the most MB of gradients in one data-parallel bucket (DDP's bucket_cap_mb; a larger weight "
                        "is a bucket alone); default: --zero 0 and 1 half a stage, within 4-25 MB, --zero 2 and 3 "
                        "4 MB (--zero 3: a bucket a block, the cap bounds the buckets in flight)")
    return p


def validate_optimizer(args, program):
    """The optimizer flags; sets --lr to the optimizer's default when it was not given."""
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    for name in ("beta1", "beta2"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 <= value < 1):
            fail(f"--{name} {value} must be in [0, 1) (AdamW's default: --beta1 0.9 --beta2 0.999)")
    if not (math.isfinite(args.adam_eps) and args.adam_eps > 0):
        fail(f"--adam-eps {args.adam_eps} must be a finite number > 0, e.g. 1e-8")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        fail(f"--weight-decay {args.weight_decay} must be a finite number >= 0 (0: no decay), e.g. 0.01")
    if args.zero3_gather is not None and args.zero != 3:
        fail(f"--zero3-gather {args.zero3_gather} says when --zero 3 gathers the weights, and this run has "
             f"--zero {args.zero}; add --zero 3, or drop --zero3-gather")
    if args.zero == 3 and args.zero3_gather is None:   # one microbatch: free after use, as FSDP2 does
        args.zero3_gather = "microbatch" if getattr(args, "microbatches", 1) == 1 else "step"
    if args.zero and program not in ZERO_PROGRAMS:
        fail(f"--zero {args.zero}: {program}.py has no data-parallel axis to split the optimizer state over; "
             f"drop --zero, or run {' or '.join(p + '.py' for p in ZERO_PROGRAMS)}, which have one")


def validate_common(args, program):
    """Checks every program shares; called right after parsing, before any collective."""
    for name in ("steps", "batch_size", "layers", "hidden", "heads", "threads"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be a positive integer")
    if args.log_every <= 0:
        fail(f"--log-every {args.log_every} must be a positive integer (1: read the scalars after every step)")
    validate_optimizer(args, program)
    if args.eval_every < 0:
        fail(f"--eval-every {args.eval_every} must be >= 0 (0 turns evaluation off)")
    for name in ("lr", "momentum", "timeout_s"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (value == 0 and name != "momentum"):
            fail(f"--{name.replace('_', '-')} {value} must be a finite number > 0"
                 + (" (or 0 for momentum)" if name == "momentum" else ""))
    bucket_mb = getattr(args, "bucket_mb", None)
    if bucket_mb is not None and not (math.isfinite(bucket_mb) and bucket_mb > 0):
        fail(f"--bucket-mb {bucket_mb} must be a number of MB > 0, e.g. 25 (DDP's default) or 0.05 for several "
             f"buckets a stage of a small model (omit it for the default)")
    if not 0 <= args.dropout < 1:
        fail(f"--dropout {args.dropout} must be a probability in [0, 1), e.g. 0.1")
    if args.clip_grad_norm is not None and not (math.isfinite(args.clip_grad_norm) and args.clip_grad_norm > 0):
        fail(f"--clip-grad-norm {args.clip_grad_norm} must be a finite number > 0 (omit it for no clipping)")
    if args.model == "mlp" and args.layers < 2:
        fail(f"--layers {args.layers}: the mlp needs at least 2 Linear layers")
    if args.model in ("vit", "gpt") and args.hidden % args.heads:
        fail(f"--hidden {args.hidden} is not divisible by --heads {args.heads}; "
             f"choose --heads among the divisors of {args.hidden}")
    if args.model == "vit" and (args.patch_size <= 0 or 32 % args.patch_size):
        fail(f"--patch-size {args.patch_size} does not divide the 32-pixel side of an image; "
             f"use one of 1, 2, 4, 8, 16, 32 (4: 64 tokens, 2: 256, 1: 1024)")
    validate_text(args, program)
    validate_experts(args, program)
    if args.log_file is None:
        args.log_file = os.path.join("logs", f"{program}.jsonl")
    if args.checkpoint_dir is not None:   # what it holds is read later, with torch (mp.checkpoint.validate)
        if args.save_every <= 0:
            fail(f"--save-every {args.save_every} must be a positive integer")
        if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
            fail(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory; give a directory path "
                 f"(it is created if missing)")


def validate_text(args, program):
    """The gpt's flags and its data; sets args.mask_max (the longest prefix --loss-mask leaves out, 0: none)."""
    if args.model != "gpt":
        if args.data == "shakespeare":
            fail(f"--data shakespeare is text, for --model gpt; --model {args.model} reads images: "
                 f"use --data cifar10 or synthetic, or --model gpt")
        return
    if program not in GPT_PROGRAMS:
        fail(f"--model gpt: {program}.py does not train the language model yet (so far: "
             f"{', '.join(p + '.py' for p in GPT_PROGRAMS)}); use --model vit here")
    if args.data == "cifar10":
        fail("--data cifar10 holds images and --model gpt reads text: use --data shakespeare, synthetic or auto, "
             "or --text-file PATH")
    if args.text_file is not None and args.data != "auto":
        fail(f"--text-file {args.text_file} is the data, and --data {args.data} asks for other data; drop --data")
    if args.seq_len <= 0:
        fail(f"--seq-len {args.seq_len} must be a positive integer, e.g. 64")
    kind, _, n = args.loss_mask.partition(":")
    if kind not in ("none", "prefix") or (kind == "none" and n) or (n and not n.isdigit()):
        fail(f"--loss-mask {args.loss_mask}: use none, prefix (a prefix of 0 to seq-len/2 tokens) or prefix:N")
    args.mask_max = 0 if kind == "none" else int(n) if n else args.seq_len // 2
    if args.mask_max >= args.seq_len:
        fail(f"--loss-mask {args.loss_mask} could leave out all {args.seq_len} tokens of a sample (--seq-len "
             f"{args.seq_len}), which then has no valid token; use prefix:N with N at most {args.seq_len - 1}")
