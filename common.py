"""Plumbing shared by every program; the lessons live in the programs themselves.

What is here: the shared command-line flags and their validation, the torchrun environment and
process group, seeding, the three models as ordered lists of blocks, and the metrics log. The data
(CIFAR-10 or a synthetic stand-in) is in data.py.
"""
import argparse
import copy
import datetime
import itertools
import json
import math
import os
import resource
import sys
import time
import traceback
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from keyed_dropout import DropoutKeys, KeyedDropout

NUM_CLASSES = 10
# gelu, the default: smooth, so a 1e-7 rounding difference between layouts stays 1e-7; relu's kink
# flips a unit on or off when its input sits near 0 and turns the same difference into a visible one
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}

# ----------------------------------------------------------------------------- errors and flags


def note_one_rank(what):
    """A parallel program started as one process (python prog.py, or torchrun with one rank) runs, as
    the contract allows, but splits nothing: say so once, with what to launch instead."""
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        print(f"note: one rank (WORLD_SIZE 1): {what}; launch it with torchrun --nproc-per-node N to split "
              f"the work over N ranks", flush=True)


def print_error(message):
    """One `error:` line in a single write, so the lines of ranks sharing a stderr pipe never interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def fail(message, seen_by="every rank"):
    """Bad input: one `error:` line and exit status 2 on every rank, printed once where it is seen.
    seen_by "every rank": what every rank checks alike (the flags, WORLD_SIZE), printed by rank 0;
    "every node": what each machine checks for itself (its --data-dir), printed by each node's local
    rank 0, so a node whose files are damaged says so even when rank 0's are fine; "this rank": what
    only this rank detects (a NaN loss on the loss owner), printed here."""
    printer = {"every rank": "RANK", "every node": "LOCAL_RANK", "this rank": None}[seen_by]
    if printer is None or int(os.environ.get(printer, 0)) == 0:
        print_error(message)
    sys.exit(2)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default after its help."""

    def _format_action(self, action):
        if action.option_strings and not any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            action = copy.copy(action)
            help_ = action.help or ""
            if "%(default)" not in help_:
                action.help = f"{help_} (default: %(default)s)".lstrip()
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own mistakes get the same one-line form
        fail(f"{message} (see --help)")


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
    from checkpoint import validate   # checkpoint.py imports this module: imported here, when both exist
    validate(args)


# ----------------------------------------------------------------------------- distributed setup


@dataclass
class Env:
    """Who this process is under torchrun (a plain `python prog.py` is rank 0 of 1)."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


def torchrun_env(backend="auto"):
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":  # nccl needs one GPU per local rank; otherwise share the CPU over gloo
        backend = "nccl" if gpus >= local_world else "gloo"
    if backend == "nccl" and gpus < local_world:
        fail(f"--backend nccl needs one GPU per local rank: {local_world} local ranks, {gpus} GPUs; "
             f"use --backend gloo or fewer processes per node")
    if backend == "nccl" and world > 1 and "LOCAL_RANK" not in os.environ:
        fail(f"--backend nccl at world size {world} needs LOCAL_RANK (which GPU is mine), which this "
             f"launcher did not set: every rank would use cuda:0; launch with torchrun, or set LOCAL_RANK")
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    return Env(rank, world, local_rank, local_world, backend, device)


def agree_on_backend(env, requested, timeout_s, store=None):
    """--backend auto is decided from this node's GPU count, so nodes with different counts would
    pick different backends and hang in the first collective. On one node the choice is the same
    everywhere; across nodes the ranks compare choices on torchrun's store before any process group
    exists, and all refuse with the numbers if they differ."""
    if requested != "auto" or env.world_size == env.local_world_size:
        return
    if store is None:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            fail(f"--backend auto on {env.world_size // env.local_world_size} nodes needs torchrun (its store "
                 f"lets the nodes agree on one backend); use --backend gloo or --backend nccl")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        store = dist.PrefixStore(f"backend-auto/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    store.set(str(env.rank), env.backend)
    choices = [store.get(str(r)).decode() for r in range(env.world_size)]
    if len(set(choices)) > 1:
        nccl = [r for r, c in enumerate(choices) if c == "nccl"]
        fail(f"--backend auto chose nccl on ranks {nccl} and gloo on the others (nodes with different GPU "
             f"counts); pass --backend gloo, or --backend nccl with one GPU per local rank on every node")


class CommError(RuntimeError):
    """A message or collective that gave up (timeout, or a peer that died): the job cannot go on."""


def is_comm_failure(e):
    return isinstance(e, (CommError, dist.DistError)) or "gloo" in str(e)   # gloo raises plain RuntimeErrors


@contextmanager
def awaiting(what, timeout_s):
    """Name what the code inside waits for, so a timeout says it: `rank 1 waited for <what> ...`."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CommError) or not is_comm_failure(e):
            raise
        raise CommError(f"{what}, and gave up (timeout {timeout_s:g} s): {str(e).splitlines()[0][:160]}") from None


def group_timeout(env, timeout_s):
    """The process group's timeout. On nccl it arms the watchdog, which aborts the process (no
    `error:` line) once a collective has run that long; a hang inside a step should reach the step's
    own bounded wait (clock) first, which starts at the step's end: hence twice the time, and a margin."""
    return datetime.timedelta(seconds=timeout_s if env.device.type != "cuda" else 2 * timeout_s + 30)


@contextmanager
def distributed(args):
    """Threads, process group with a timeout (a bug becomes an error, not a hang), teardown. A
    communication failure ends this rank with one `error:` line and exit status 1. One process
    (world size 1, `python prog.py`) gets a process group of its own too, so every collective of
    --check, --timeline and the summary runs unchanged."""
    torch.set_num_threads(args.threads)
    env = torchrun_env(args.backend)
    agree_on_backend(env, args.backend, args.timeout_s)
    if env.device.type == "cuda":
        # no TORCH_NCCL_BLOCKING_WAIT: it would turn every wait into a CPU spin, so the host could
        # never queue work ahead of the GPU. A hang ends at the step's one bounded wait (clock).
        torch.cuda.set_device(env.device)
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                            store=process_group_store(env, args), timeout=group_timeout(env, args.timeout_s),
                            device_id=env.device if env.device.type == "cuda" else None)
    try:
        # every rank is up; and on nccl, batch_isend_irecv must not be the first collective
        with awaiting(f"rank {env.rank} waited for all {env.world_size} ranks to start", args.timeout_s):
            dist.barrier()
        yield env
    except BaseException as e:  # noqa: BLE001 (every way out must skip the teardown below)
        leave_without_teardown(e)
    dist.destroy_process_group()


def process_group_store(env, args):
    """One process: a store of its own. Under torchrun: torchrun's store, with this attempt's keys
    under a prefix of their own. torch 2.15's torchrun no longer prefixes a restarted attempt's keys
    (--max-restarts), so without it the new ranks would read the dead attempt's gloo addresses and
    hang or be refused in init_process_group."""
    if env.world_size == 1:
        return dist.HashStore()
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None    # another launcher: init_process_group's default (env://)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    return dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def leave_without_teardown(e):
    """End this rank after an exception without destroy_process_group: on nccl it drains pending
    work, so a rank that failed outside communication (or stopped with an `error:` line) would
    stall until its peers time out. A communication failure prints one `error:` line (exit 1); an
    exit keeps its status; anything else is our bug and keeps its traceback (exit 1)."""
    if isinstance(e, SystemExit):
        exit_now(e.code if isinstance(e.code, int) else 1)
    if isinstance(e, RuntimeError) and is_comm_failure(e):
        print_error(e)
    else:
        traceback.print_exception(e)
    exit_now(1)


def replicas_identical(params, group, device="cpu"):
    """Are these parameters bit-identical on every rank of `group`? (Replicas must be: same start,
    same gradients, same update.) A collective of every rank of the world, even those in other
    groups: every rank learns the answer for all groups. A rank may hold none (a 3-D stage of
    column-parallel layers only): it takes part with an empty tensor."""
    flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0, device=device)
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, flat, group=group)
    same = torch.tensor([int(all(torch.equal(flat, other) for other in every))], device=flat.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def exit_now(status):
    """Flush and leave without running gloo's destructors, which (seen in torch 2.13) sometimes abort
    (SIGABRT, "terminate called without an active exception") after all work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def seed_everything(seed):
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ----------------------------------------------------------------------------- models


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections, so that tensor parallelism can
    give each rank whole heads by slicing rows of q, k, v and columns of proj. The number of heads
    is read off the weights, so a sliced copy runs unchanged on its local heads."""

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        attn = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop1(attn(ln1(x))), then x + drop2(mlp(ln2(x))). LayerNorm is per
    token, so it never mixes samples: exact under microbatching and data parallelism."""

    def __init__(self, dim, heads, dropout=None, act=nn.GELU):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), act(), nn.Linear(2 * dim, dim))
        self.drop1, self.drop2 = dropout() if dropout else nn.Identity(), dropout() if dropout else nn.Identity()

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class PatchEmbed(nn.Module):
    """4x4 patches of a 32x32 image -> 64 tokens of width dim, plus a learned position embedding."""

    def __init__(self, dim, patch=4):
        super().__init__()
        self.conv = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, (32 // patch) ** 2, dim))

    def forward(self, x):
        return self.conv(x).flatten(2).transpose(1, 2) + self.pos


class Head(nn.Module):
    """Final LayerNorm, mean over tokens, linear classifier."""

    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x):
        return self.fc(self.ln(x).mean(dim=1))


def cnn_blocks(dropout, act=nn.GELU):
    """The PyTorch CIFAR-10 tutorial network in 5 blocks, with two changes made for the
    equivalence contract. One GroupNorm with one group per channel: its statistics are per sample
    and per channel, so it is exact under microbatching, data parallelism and channel-sharded
    tensor parallelism alike (BatchNorm would not be). GELU and average pooling instead of ReLU and
    max pooling: kinks turn float32 rounding differences (1e-7, from summing a batch's gradient in
    another order) into 1e-1 loss differences within ~100 steps; smooth layers keep them at 1e-7.
    A generator: each block is constructed (drawing its initial weights) only when it is asked for.
    dropout(): a dropout layer, before each hidden fc layer (fc1, fc2); it ends the block before,
    so the parameters keep their names whether or not there is dropout. act: --activation (relu
    swaps the activation only; the pooling stays average)."""
    yield nn.Sequential(nn.Conv2d(3, 6, 5), act(), nn.AvgPool2d(2))                          # 6x14x14
    yield nn.Sequential(nn.Conv2d(6, 16, 5), nn.GroupNorm(16, 16), act(), nn.AvgPool2d(2),  # 16x5x5
                        dropout())
    yield nn.Sequential(nn.Flatten(), nn.Linear(16 * 5 * 5, 120), act(), dropout())
    yield nn.Sequential(nn.Linear(120, 84), act())
    yield nn.Sequential(nn.Linear(84, NUM_CLASSES))


def mlp_blocks(layers, hidden, dropout, act=nn.GELU):
    """Flatten, Linear(3072, H), GELU, (Linear(H, H), GELU) x (L-2), Linear(H, 10); dropout() after
    each hidden activation. --layers 2 --activation relu: the course's Sequential(linear1, relu,
    linear2), one block per Linear."""
    yield nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), act(), dropout())
    for _ in range(layers - 2):
        yield nn.Sequential(nn.Linear(hidden, hidden), act(), dropout())
    yield nn.Sequential(nn.Linear(hidden, NUM_CLASSES))


def vit_blocks(layers, hidden, heads, dropout, act=nn.GELU):
    """dropout(): on the attention output and on the MLP output, before each residual add; act: the
    block MLP's activation."""
    yield PatchEmbed(hidden)
    for _ in range(layers):
        yield TransformerBlock(hidden, heads, dropout, act)
    yield Head(hidden)


def num_blocks(args):
    return {"cnn": 5, "mlp": args.layers, "vit": args.layers + 2}[args.model]


def model_blocks(args, keys):
    """The model's blocks in order, each constructed only when the one before has been consumed.
    Every block's initial weights come from one random stream seeded by --seed, drawn in this
    order, so block i is bit-identical in every program whether or not blocks 0..i-1 were kept.
    The dropout layers are numbered in the same order (the layer in their masks' key)."""
    seed_everything(args.seed)
    layers = itertools.count()

    def dropout():   # keyed masks (keyed_dropout.py): every layout draws the baseline's
        return KeyedDropout(getattr(args, "dropout", 0.0), next(layers), keys)

    act = ACTIVATIONS[getattr(args, "activation", "gelu")]   # benchmarks' hand-made args may predate the flag
    if args.model == "cnn":
        return cnn_blocks(dropout, act)
    if args.model == "mlp":
        return mlp_blocks(args.layers, args.hidden, dropout, act)
    return vit_blocks(args.layers, args.hidden, args.heads, dropout, act)


def build_model(args, keep=None, device="cpu"):
    """The model as nn.Sequential of blocks (the units a pipeline cuts into stages), built from
    --seed so that every rank and every program starts from bit-identical weights.

    The memory contract: keep(i, block) sees each full block right after it is built and returns
    what this rank holds of it (the block, a tensor-parallel slice of it) or None; the full block
    is dropped before the next one is built, so no rank ever holds more than its part plus one
    block. Kept blocks keep their index as their name ("2.1.weight" is the baseline's name on
    every rank), so a rank's parameters are named in the full model's coordinates. Without keep:
    the whole model, for the baseline and for --check's reference."""
    kept, full_mb, keys = OrderedDict(), 0.0, DropoutKeys(args.seed)
    for i, block in enumerate(model_blocks(args, keys)):
        full_mb += param_mb(block.parameters())
        block = keep(i, block) if keep else block
        if block is not None:
            kept[str(i)] = block.to(device)
    model = nn.Sequential(kept)
    model.full_param_mb = full_mb     # what the whole model's parameters take, for the summary record
    model.dropout_keys = keys         # the training loop sets the step and the first sample's index
    return model


def param_mb(params):
    return sum(p.numel() * p.element_size() for p in params) / 2**20


def make_optimizer(params, args):
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)


# ----------------------------------------------------------------------------- metrics


class MetricsLog:
    """JSON lines, one record per event, flushed at once so a crash leaves a valid prefix.
    Only the rank that owns the loss writes (enabled=True); the others hold a no-op log."""

    def __init__(self, path, enabled, resuming=False):
        self.file, self.earlier = None, []
        if enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if resuming and os.path.exists(path):   # a resumed run keeps the earlier steps' records
                with open(path) as f:
                    self.earlier = [r for r in map(parse_record, f) if r]
            self.file = open(path, "w")

    def begin(self, program, args, env, start=0, layout=None):
        """The config record; for a run resumed at step `start`, then the earlier run's train and
        eval records of the steps before it (the dead attempt's later ones are dropped: they are
        trained again) and a resume record."""
        self.config(program, args, env)
        if start:
            for record in self.earlier:
                if record.get("event") in ("train", "eval") and record.get("step", start) < start:
                    self.write(record.pop("event"), **record)
            self.write("resume", step=start, **{"from": layout})

    def write(self, event, **fields):
        if self.file:
            self.file.write(json.dumps({"event": event, **fields}) + "\n")
            self.file.flush()

    def config(self, program, args, env):
        self.write("config", program=program, args=vars(args), world_size=env.world_size,
                   backend=env.backend, device=str(env.device))

    def close(self):
        if self.file:
            self.file.close()


def parse_record(line):
    try:
        return json.loads(line)
    except ValueError:    # a line cut short by a crash
        return None


def to_device(tensor, device):
    """A batch onto the rank's device. On a GPU through pinned (page-locked) host memory, which lets
    the copy run asynchronously: the CPU goes on queueing kernels, which the copy precedes on the stream."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def clock(device, timeout_s=None, awaited=lambda: "the step's queued work"):
    """perf_counter for step times; on a GPU after the queued work (the optimizer step's kernels
    included) has run, or the clock would stop while the device is still busy. That is the step's
    one CPU wait on a GPU (nccl's waits only order the streams), so it is bounded: a step that never
    finishes ends in one CommError naming awaited() (the last exchange) after timeout_s."""
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        bounded_wait(done.query, timeout_s, awaited)
    return time.perf_counter()


def bounded_wait(finished, timeout_s, awaited):
    """Poll finished() until it is true; after timeout_s (None: for ever) raise a CommError."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not finished():
        if deadline is not None and time.monotonic() > deadline:
            raise CommError(f"waited {timeout_s:g} s for {awaited()} to finish on the device and gave up "
                            f"(a peer is gone or a message was never matched)")
        time.sleep(20e-6)


def start_memory_count(device):
    """Call after set-up: on a GPU the peak counts from here (the CPU's peak RSS cannot be reset,
    so it includes set-up: see memory_fields' label)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device, kind="allocated"):
    """This process's peak resident set (CPU), or the peak of GPU memory held by tensors
    (allocated) or by PyTorch's caching allocator (reserved, what the GPU actually lost), in MB."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved if kind == "reserved" else torch.cuda.max_memory_allocated
        return peak(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KB


def gather_per_rank(env, value, digits=1):
    """{rank: value} from every rank (a collective: every rank must call it)."""
    mine = torch.tensor([value], dtype=torch.float64, device=env.device)
    if env.world_size == 1:
        return {0: round(mine.item(), digits)}
    every = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)
    return {r: round(t.item(), digits) for r, t in enumerate(every)}


def gather_peak_memory(env, kind="allocated"):
    return gather_per_rank(env, peak_memory_mb(env.device, kind))


def memory_fields(env, params, model_param_mb):
    """The summary record's memory, labelled so that CPU and GPU tables are not mixed up:
    peak_memory_mb is peak RSS on the CPU, peak allocated on a GPU (plus peak_reserved_mb).
    param_mb: what each rank's parameters take (gradients and momentum take as much again each);
    model_param_mb: the whole model's, which a pipeline's stages sum to."""
    fields = {"param_mb": gather_per_rank(env, param_mb(params), digits=4), "model_param_mb": round(model_param_mb, 4)}
    if env.device.type != "cuda":
        return {"peak_memory_mb": gather_peak_memory(env),
                "peak_memory_kind": "cpu peak RSS of the process (includes set-up)", **fields}
    return {"peak_memory_mb": gather_peak_memory(env), "peak_reserved_mb": gather_peak_memory(env, "reserved"),
            "peak_memory_kind": "cuda peak allocated by tensors since set-up (peak_reserved_mb: by the allocator)",
            **fields}


def check_finite(loss, step):
    if not math.isfinite(loss):
        fail(f"the loss became {loss} at step {step}; training stopped (try a smaller --lr)", seen_by="this rank")


class Progress:
    """A short console line every few seconds, and the step times for the summary. Steps are
    numbered from 0 here as in the metrics log and the plots: the last of 300 is `step 299 (of 0-299)`."""

    def __init__(self, total_steps, enabled, every_s=5.0):
        self.total, self.enabled, self.every_s = total_steps, enabled, every_s
        self.step_times = []
        self.last_print = time.perf_counter()

    def update(self, step, loss, step_time, samples):
        self.step_times.append(step_time)
        now = time.perf_counter()
        if self.enabled and (now - self.last_print >= self.every_s or step == self.total - 1):
            print(f"step {step} (of 0-{self.total - 1})  loss {loss:.4f}  {samples / step_time:.0f} samples/s",
                  flush=True)
            self.last_print = now

    def median_step_time(self):
        times = sorted(self.step_times[1:] or self.step_times)  # step 0 pays warm-up costs
        return times[len(times) // 2] if times else float("nan")
