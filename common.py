"""Plumbing shared by every program; the lessons live in the programs themselves.

What is here: the shared command-line flags and their validation, the torchrun environment and
process group, seeding, the data (CIFAR-10 or a synthetic stand-in) as a global-batch sequence that
every rank can draw identically, the three models as ordered lists of blocks, and the metrics log.
"""
import argparse
import copy
import datetime
import json
import math
import os
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

NUM_CLASSES = 10
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

# ----------------------------------------------------------------------------- errors and flags


def print_error(message):
    """One `error:` line in a single write, so the lines of ranks sharing a stderr pipe never interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def fail(message, every_rank_sees_it=True):
    """Bad input: one `error:` line and exit status 2 on every rank. Input that every rank checks
    alike (the flags, WORLD_SIZE) is reported by rank 0 alone, so the user reads it once; pass
    every_rank_sees_it=False for what only this rank detects (a NaN loss on the loss owner)."""
    if not every_rank_sees_it or int(os.environ.get("RANK", 0)) == 0:
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
    p.add_argument("--data", choices=["cifar10", "synthetic"], default="cifar10")
    p.add_argument("--data-dir", default="./data")
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
    if args.model == "mlp" and args.layers < 2:
        fail(f"--layers {args.layers}: the mlp needs at least 2 Linear layers")
    if args.model == "vit" and args.hidden % args.heads:
        fail(f"--hidden {args.hidden} is not divisible by --heads {args.heads}; "
             f"choose --heads among the divisors of {args.hidden}")
    if args.log_file is None:
        args.log_file = os.path.join("logs", f"{program}.jsonl")


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
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    return Env(rank, world, local_rank, local_world, backend, device)


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


@contextmanager
def distributed(args):
    """Threads, process group with a timeout (a bug becomes an error, not a hang), teardown. A
    communication failure ends this rank with one `error:` line and exit status 1."""
    torch.set_num_threads(args.threads)
    env = torchrun_env(args.backend)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if env.world_size > 1:
        dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=args.timeout_s),
                                device_id=env.device if env.device.type == "cuda" else None)
    try:
        if env.world_size > 1:  # every rank is up; and on nccl, batch_isend_irecv must not be the first collective
            with awaiting(f"rank {env.rank} waited for all {env.world_size} ranks to start", args.timeout_s):
                dist.barrier()
        yield env
    except RuntimeError as e:
        if not is_comm_failure(e):
            raise
        print_error(e)
        exit_now(1)                           # the process group is broken: do not wait on it again
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_now(status):
    """Flush and leave without running gloo's destructors, which in torch 2.13 sometimes abort
    (SIGABRT, "terminate called without an active exception") after all work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def seed_everything(seed):
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ----------------------------------------------------------------------------- data


class SyntheticData:
    """CIFAR-shaped, learnable and deterministic: each class is a smooth random 3x32x32 pattern;
    a sample is its class pattern at a random contrast plus noise. Batches are generated from
    (seed, step) on demand, so memory stays small however long the run."""

    def __init__(self, seed, test_size=2000):
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(NUM_CLASSES, 3, 8, 8, generator=g)
        self.prototypes = F.interpolate(coarse, size=32, mode="bilinear", align_corners=False)
        self.seed = seed
        self.test_set = self._draw(torch.Generator().manual_seed(seed + 7919), test_size)

    def _draw(self, g, n):
        y = torch.randint(NUM_CLASSES, (n,), generator=g)
        contrast = 0.03 + 0.12 * torch.rand(n, 1, 1, 1, generator=g)
        x = contrast * self.prototypes[y] + torch.randn(n, 3, 32, 32, generator=g)
        return x, y

    def batch(self, step, batch_size):
        return self._draw(torch.Generator().manual_seed(self.seed * 1_000_003 + step), batch_size)

    def labels(self, step, batch_size):
        """batch(step, batch_size)[1] without drawing the images (the labels are drawn first)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(NUM_CLASSES, (batch_size,), generator=g)


class Cifar10Data:
    """CIFAR-10 held as uint8 tensors, normalised per batch; the order is a seeded permutation
    per epoch, so batch k is the same on every rank and in every program."""

    def __init__(self, data_dir, seed):
        try:
            import torchvision  # imported here: a torchvision built for another torch fails to import
        except Exception as e:  # noqa: BLE001 (any import failure means the same thing here)
            fail(f"--data cifar10 needs torchvision, which failed to import ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:120]}); install a torchvision matching torch "
                 f"{torch.__version__}, or use --data synthetic")
        self.train = self._load(torchvision, data_dir, train=True)
        self.test = self._load(torchvision, data_dir, train=False)
        self.seed = seed

    @staticmethod
    def _load(torchvision, data_dir, train):
        try:
            ds = torchvision.datasets.CIFAR10(data_dir, train=train, download=True)
        except Exception as e:  # noqa: BLE001 (no network, a partial file, a full disk, ...)
            fail(f"CIFAR-10 is not in --data-dir {data_dir} and could not be downloaded "
                 f"({type(e).__name__}); download it on a machine with network into that folder, "
                 f"or use --data synthetic")
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # uint8 N x 3 x 32 x 32
        return x, torch.tensor(ds.targets)

    @staticmethod
    def normalise(x):
        mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        return (x.float() / 255 - mean) / std

    def batch(self, step, batch_size):
        x, y = self.train
        per_epoch = len(y) // batch_size
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed + epoch))
        idx = order[i * batch_size:(i + 1) * batch_size]
        return self.normalise(x[idx]), y[idx]

    def labels(self, step, batch_size):
        """batch(step, batch_size)[1] without normalising the images."""
        per_epoch = len(self.train[1]) // batch_size
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(self.train[1]), generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.train[1][order[i * batch_size:(i + 1) * batch_size]]

    @property
    def test_set(self):
        return self.normalise(self.test[0]), self.test[1]


def load_data(args):
    """The data set of --data; call before init so a missing data set fails before any collective."""
    if args.data == "synthetic":
        return SyntheticData(args.seed)
    return Cifar10Data(args.data_dir, args.seed)


def test_batches(data, batch_size):
    """The test split in fixed-size chunks (the last may be smaller)."""
    x, y = data.test_set
    return list(zip(x.split(batch_size), y.split(batch_size)))


def dp_slice(tensor, dp_rank, dp_size):
    """Data-parallel replica dp_rank's contiguous, equal share of a global batch."""
    n = tensor.shape[0] // dp_size
    return tensor[dp_rank * n:(dp_rank + 1) * n]


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
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)). LayerNorm is per token, so it
    never mixes samples: exact under microbatching and data parallelism."""

    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


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


def cnn_blocks():
    """The PyTorch CIFAR-10 tutorial network in 5 blocks, with two changes made for the
    equivalence contract. One GroupNorm with one group per channel: its statistics are per sample
    and per channel, so it is exact under microbatching, data parallelism and channel-sharded
    tensor parallelism alike (BatchNorm would not be). GELU and average pooling instead of ReLU and
    max pooling: kinks turn float32 rounding differences (1e-7, from summing a batch's gradient in
    another order) into 1e-1 loss differences within ~100 steps; smooth layers keep them at 1e-7."""
    return [
        nn.Sequential(nn.Conv2d(3, 6, 5), nn.GELU(), nn.AvgPool2d(2)),                          # 6x14x14
        nn.Sequential(nn.Conv2d(6, 16, 5), nn.GroupNorm(16, 16), nn.GELU(), nn.AvgPool2d(2)),  # 16x5x5
        nn.Sequential(nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.GELU()),
        nn.Sequential(nn.Linear(120, 84), nn.GELU()),
        nn.Sequential(nn.Linear(84, NUM_CLASSES)),
    ]


def mlp_blocks(layers, hidden):
    blocks = [nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.GELU())]
    blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers - 2)]
    return blocks + [nn.Sequential(nn.Linear(hidden, NUM_CLASSES))]


def vit_blocks(layers, hidden, heads):
    return [PatchEmbed(hidden)] + [TransformerBlock(hidden, heads) for _ in range(layers)] + [Head(hidden)]


def build_model(args):
    """The full model as nn.Sequential of blocks (the units a pipeline cuts into stages), built
    from --seed so that every rank and every program starts from bit-identical weights."""
    seed_everything(args.seed)
    if args.model == "cnn":
        blocks = cnn_blocks()
    elif args.model == "mlp":
        blocks = mlp_blocks(args.layers, args.hidden)
    else:
        blocks = vit_blocks(args.layers, args.hidden, args.heads)
    return nn.Sequential(*blocks)


def make_optimizer(params, args):
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)


# ----------------------------------------------------------------------------- metrics


class MetricsLog:
    """JSON lines, one record per event, flushed at once so a crash leaves a valid prefix.
    Only the rank that owns the loss writes (enabled=True); the others hold a no-op log."""

    def __init__(self, path, enabled):
        self.file = None
        if enabled:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.file = open(path, "w")

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


def peak_memory_mb(device):
    """This process's peak resident set (CPU) or peak allocated GPU memory, in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KB


def gather_peak_memory(env):
    """{rank: MB} from every rank (a collective: every rank must call it)."""
    mine = torch.tensor([peak_memory_mb(env.device)], dtype=torch.float64, device=env.device)
    if env.world_size == 1:
        return {0: round(mine.item(), 1)}
    every = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)
    return {r: round(t.item(), 1) for r, t in enumerate(every)}


def check_finite(loss, step):
    if not math.isfinite(loss):
        fail(f"the loss became {loss} at step {step}; training stopped (try a smaller --lr)", every_rank_sees_it=False)


class Progress:
    """A short console line every few seconds, and the step times for the summary. Steps are
    numbered from 0 here as in the metrics log and the plots: the last of 300 is `step 299/299`."""

    def __init__(self, total_steps, enabled, every_s=5.0):
        self.total, self.enabled, self.every_s = total_steps, enabled, every_s
        self.step_times = []
        self.last_print = time.perf_counter()

    def update(self, step, loss, step_time, samples):
        self.step_times.append(step_time)
        now = time.perf_counter()
        if self.enabled and (now - self.last_print >= self.every_s or step == self.total - 1):
            print(f"step {step}/{self.total - 1}  loss {loss:.4f}  {samples / step_time:.0f} samples/s",
                  flush=True)
            self.last_print = now

    def median_step_time(self):
        times = sorted(self.step_times[1:] or self.step_times)  # step 0 pays warm-up costs
        return times[len(times) // 2] if times else float("nan")
