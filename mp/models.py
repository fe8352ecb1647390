"""The four models as ordered lists of blocks (the units a pipeline cuts into stages), built block
by block from --seed, so that every rank and every program starts from bit-identical weights: three
image classifiers (cnn, mlp, vit) and a causal language model on bytes (gpt)."""
import itertools
import math
from collections import OrderedDict
from functools import partial

import torch
import torch.nn as nn

from mp.dropout import DropoutKeys, KeyedDropout
from mp.moe import MixtureOfExperts
from mp.sizes import ACTIVATION_NAMES, VOCAB, num_blocks  # noqa: F401 (num_blocks: the programs read it here)


NUM_CLASSES = 10


# gelu, the default: smooth, so a 1e-7 rounding difference between layouts stays 1e-7; relu's kink
# flips a unit on or off when its input sits near 0 and turns the same difference into a visible one
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}
assert tuple(ACTIVATIONS) == ACTIVATION_NAMES   # the names --activation offers (mp.flags)


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections, so that tensor parallelism can
    give each rank whole heads by slicing rows of q, k, v and columns of proj. The number of heads
    is read off the weights, so a sliced copy runs unchanged on its local heads. causal (the gpt):
    token i attends to tokens 0..i only, so that predicting token i + 1 never sees it."""
    causal = False   # the class's: a subclass built without this __init__ (a tp rank's slice) is not causal

    def __init__(self, dim, heads, causal=False):
        super().__init__()
        self.head_dim, self.causal = dim // heads, causal
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if self.causal:   # the later keys' scores to -inf: a weight of exactly 0 after the softmax
            scores = scores.masked_fill(causal_mask(t, t, x.device), float("-inf"))
        return self.proj((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, -1))


def causal_mask(queries, keys, device, offset=0):
    """[queries, keys], True where key j comes after query i (j > i + offset): the scores a causal
    model hides. offset: the queries' first position minus the keys' (context parallelism's blocks)."""
    i = torch.arange(queries, device=device).unsqueeze(1)
    return torch.arange(keys, device=device).unsqueeze(0) > i + offset


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop1(attn(ln1(x))), then x + drop2(mlp(ln2(x))). LayerNorm is per
    token, so it never mixes samples: exact under microbatching and data parallelism. moe(): a
    mixture of experts in place of the MLP (--experts, mp/moe.py)."""

    def __init__(self, dim, heads, dropout=None, act=nn.GELU, moe=None, causal=False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal)
        self.mlp = moe() if moe else nn.Sequential(nn.Linear(dim, 2 * dim), act(), nn.Linear(2 * dim, dim))
        self.drop1, self.drop2 = dropout() if dropout else nn.Identity(), dropout() if dropout else nn.Identity()

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class PatchEmbed(nn.Module):
    """patch x patch squares of a 32x32 image -> (32/patch)^2 tokens of width dim (4: 64 tokens), plus a
    learned position embedding."""

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


class TokenEmbed(nn.Module):
    """The gpt's first block: each byte's learned vector (tok, VOCAB x dim) plus its position's (pos).
    Both drawn from N(0, 0.02^2), GPT-2's scale: tied to the head (--tie-embeddings), tok is also the
    output layer, whose logits must start small."""

    def __init__(self, dim, seq_len, vocab=VOCAB):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.pos = nn.Parameter(0.02 * torch.randn(1, seq_len, dim))

    def forward(self, tokens):
        return self.tok(tokens) + self.pos[:, :tokens.shape[1]]


class LMHead(nn.Module):
    """The gpt's last block: final LayerNorm, then a logit per byte and position, [b, s, VOCAB], from
    a weight of its own (weight) or, tied, from the embedding's (--tie-embeddings: the same Parameter
    as block 0's tok.weight, so one process's autograd sums the two uses' gradients; a pipeline, whose
    first and last stage each hold it, sums them itself)."""

    def __init__(self, dim, vocab=VOCAB, tied=None):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.weight = tied if tied is not None else nn.Parameter(0.02 * torch.randn(vocab, dim))

    def forward(self, x):
        return self.ln(x) @ self.weight.T


def gpt_blocks(layers, hidden, heads, seq_len, dropout, act=nn.GELU, moe=None, tie=False):
    """A decoder-only transformer on bytes: TokenEmbed, `layers` causal pre-norm blocks (the vit's, with
    the mask), LMHead; tie: the head reads the embedding's weight (one Parameter)."""
    embed = TokenEmbed(hidden, seq_len)
    yield embed
    for _ in range(layers):
        yield TransformerBlock(hidden, heads, dropout, act, moe, causal=True)
    yield LMHead(hidden, tied=embed.tok.weight if tie else None)


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


def vit_blocks(layers, hidden, heads, dropout, act=nn.GELU, patch=4, moe=None):
    """dropout(): on the attention output and on the MLP output, before each residual add; act: the
    block MLP's activation; patch: --patch-size; moe(): each block's mixture of experts (None: dense)."""
    yield PatchEmbed(hidden, patch)
    for _ in range(layers):
        yield TransformerBlock(hidden, heads, dropout, act, moe)
    yield Head(hidden)


def seed_everything(seed):
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def model_blocks(args, keys):
    """The model's blocks in order, each constructed only when the one before has been consumed.
    Every block's initial weights come from one random stream seeded by --seed, drawn in this
    order, so block i is bit-identical in every program whether or not blocks 0..i-1 were kept.
    The dropout layers are numbered in the same order (the layer in their masks' key)."""
    seed_everything(args.seed)
    layers = itertools.count()

    def dropout():   # keyed masks (mp/dropout.py): every layout draws the baseline's
        return KeyedDropout(getattr(args, "dropout", 0.0), next(layers), keys)

    act = ACTIVATIONS[getattr(args, "activation", "gelu")]   # benchmarks' hand-made args may predate the flag
    if args.model == "cnn":
        return cnn_blocks(dropout, act)
    if args.model == "mlp":
        return mlp_blocks(args.layers, args.hidden, dropout, act)
    moe = partial(MixtureOfExperts, args.hidden, args.experts, args.top_k, args.capacity_factor, args.aux_loss, act,
                  keys) if getattr(args, "experts", 0) else None   # --experts: each block's MLP as experts (mp/moe.py)
    if args.model == "gpt":
        return gpt_blocks(args.layers, args.hidden, args.heads, args.seq_len, dropout, act, moe, args.tie_embeddings)
    return vit_blocks(args.layers, args.hidden, args.heads, dropout, act, getattr(args, "patch_size", 4), moe)


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


def zero_sample(args, device="cpu"):
    """One sample of the model's input, zeros, batch of one: an image, or the gpt's --seq-len byte ids (what a
    pipeline runs through the blocks for the shapes between them, and --balance auto for their flops)."""
    if args.model == "gpt":
        return torch.zeros(1, args.seq_len, dtype=torch.long, device=device)
    return torch.zeros(1, 3, 32, 32, device=device)


def param_mb(params):
    return sum(p.numel() * p.element_size() for p in params) / 2**20


# ----------------------------------------------------------------------------- a rank's part in the full model's coordinates


def shard_of(model, name):
    """(dim, start, length) of parameter `name` in the full model's parameter (a tensor-parallel layer
    records it in its `shards`); None where the rank holds the whole tensor."""
    module_name, _, param_name = name.rpartition(".")
    return getattr(model.get_submodule(module_name), "shards", {}).get(param_name)


def full_slice(model, name, full):
    """The part of the full model's tensor for parameter `name` that this rank's parameter holds."""
    spec = shard_of(model, name)
    return full.narrow(*spec) if spec else full
