"""The models as the planner sees them: each block's parameters in the order torch registers them (so the
data-parallel buckets can be laid out as mp.buckets lays them), how tensor parallelism slices each one, and the
FLOPs a token costs. This project's four models (mp/models.py) are described exactly; the field's presets
(GPT-3, Llama 3, Mixtral) by their published shapes, counted the same way.

A parameter is Param(name, shape, split): split says how a tensor-parallel rank holds it, "col" (output
features cut: the weight's rows and the bias), "row" (input features cut: the weight's columns; the bias stays
whole), or None (replicated). `cut` is the feature count the tp ranks share, split like torch.tensor_split
(mp.sizes.split_sizes), or by whole heads for attention.
"""
from dataclasses import dataclass, field, replace

from mp.sizes import VOCAB, split_sizes, vit_tokens

NUM_CLASSES = 10   # mp.models.NUM_CLASSES: CIFAR-10's


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple
    split: str = None        # "col", "row" or None (replicated over tp)
    cut: tuple = None        # the tp ranks' shares of the cut dimension (None: split_sizes of it)
    expert: int = None       # the expert it belongs to (ep spreads them), None: dense

    def numel(self, tp=1, tp_rank=0):
        """Elements that tp rank tp_rank of tp holds."""
        n = 1
        for s in self.shape:
            n *= s
        if tp == 1 or self.split is None or (self.split == "row" and len(self.shape) == 1):
            return n
        dim = 0 if self.split == "col" else 1
        shares = self.cut or tuple(split_sizes(self.shape[dim], tp))
        return n // self.shape[dim] * shares[tp_rank]


@dataclass(frozen=True)
class Model:
    """A transformer (vit, gpt, presets) or this project's cnn/mlp. ffn: the feed-forward width (this project's
    blocks: 2 x hidden); gated: SwiGLU's three matrices (Llama, Mixtral); kv_heads < heads: grouped-query
    attention; tokens: the sequence a sample is (the vit's patches, the gpt's --seq-len)."""
    kind: str
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = None
    ffn: int = None
    gated: bool = False
    vocab: int = VOCAB
    tokens: int = 64
    experts: int = 0
    top_k: int = 1
    tied: bool = False
    patch: int = 4
    bias: bool = True        # this project's Linear layers have biases; Llama's do not
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def kv(self):
        return self.kv_heads or self.heads

    @property
    def ffn_width(self):
        return self.ffn or 2 * self.hidden

    def blocks(self):
        """The number of pipeline blocks (mp.sizes.num_blocks): the transformer's layers plus embedding and head."""
        return {"cnn": 5, "mlp": self.layers}.get(self.kind, self.layers + 2)


def linear(name, fan_in, fan_out, split=None, bias=True, cut=None, expert=None):
    weight = Param(f"{name}.weight", (fan_out, fan_in), split, cut, expert)
    return [weight] + ([Param(f"{name}.bias", (fan_out,), split, cut, expert)] if bias else [])


def transformer_block(m, tp=1):
    """One pre-norm block (mp.models.TransformerBlock) in registration order: ln1, ln2, attn q k v proj, then
    the MLP (fc1, fc2) or the experts (router, then each expert's fc1, fc2). Attention is cut by whole heads
    (tensor_parallel.ParallelAttention); the experts stay whole (ep spreads them)."""
    h, hd = m.hidden, m.hidden // m.heads
    q_cut = tuple(n * hd for n in split_sizes(m.heads, tp))
    kv_cut = tuple(n * hd for n in split_sizes(m.kv, tp))
    ps = [Param("ln1.weight", (h,)), Param("ln1.bias", (h,)), Param("ln2.weight", (h,)), Param("ln2.bias", (h,))]
    ps += linear("attn.q", h, h, "col", m.bias, q_cut) + linear("attn.k", h, m.kv * hd, "col", m.bias, kv_cut)
    ps += linear("attn.v", h, m.kv * hd, "col", m.bias, kv_cut) + linear("attn.proj", h, h, "row", m.bias, q_cut)
    f = m.ffn_width
    mats = (("0", h, f), ("1", h, f), ("2", f, h)) if m.gated else (("0", h, f), ("2", f, h))
    if not m.experts:
        return ps + [p for n, a, b in mats for p in linear(f"mlp.{n}", a, b, "row" if n == "2" else "col", m.bias)]
    ps += linear("mlp.router", h, m.experts, bias=False)
    for e in range(m.experts):
        ps += [p for n, a, b in mats for p in linear(f"mlp.experts.{e}.{n}", a, b, bias=m.bias, expert=e)]
    return ps


def block_params(m, i, tp=1):
    """Block i's parameters, in the order model.parameters() yields them (a module's own first, then its
    children's: PatchEmbed's pos before its conv); tp: the degree attention's whole heads are cut for."""
    if m.kind == "cnn":
        return CNN[i]
    if m.kind == "mlp":
        fan_in = 3 * 32 * 32 if i == 0 else m.hidden
        fan_out = NUM_CLASSES if i == m.layers - 1 else m.hidden
        j = 1 if i == 0 else 0   # Flatten comes first in block 0
        return linear(str(j), fan_in, fan_out, "row" if i % 2 else "col")
    h = m.hidden
    if i == 0 and m.kind == "vit":
        return [Param("pos", (1, m.tokens, h)), Param("conv.weight", (h, 3, m.patch, m.patch)),
                Param("conv.bias", (h,))]
    if i == 0:   # the byte embedding's rows split by the vocabulary over tp (mp.tp.vocab), as is the head
        return [Param("pos", (1, m.tokens, h)), Param("tok.weight", (m.vocab, h), "col")]
    if i == m.blocks() - 1 and m.kind == "vit":
        return [Param("ln.weight", (h,)), Param("ln.bias", (h,))] + linear("fc", h, NUM_CLASSES)
    if i == m.blocks() - 1:   # LMHead's own weight first, then its LayerNorm's; tied: block 0's (listed there)
        return ([] if m.tied else [Param("weight", (m.vocab, h), "col")]) + [Param("ln.weight", (h,)),
                                                                             Param("ln.bias", (h,))]
    return transformer_block(m, tp)


# the cnn's blocks (mp.models.cnn_blocks) and how tensor_parallel.py cuts each layer (parallel_cnn_block)
CNN = [linear("0", 3 * 25, 6, "col"),
       [Param("0.weight", (16, 6, 5, 5), "row"), Param("0.bias", (16,), "row"), Param("1.weight", (16,)),
        Param("1.bias", (16,))],
       linear("1", 400, 120, "col"), linear("0", 120, 84, "row"), linear("0", 84, NUM_CLASSES, "col")]


def params_of(m):
    """Every parameter's element count of the whole model."""
    return sum(p.numel() for i in range(m.blocks()) for p in block_params(m, i))


def from_args(args):
    """The Model of a program's parsed flags (mp/cli.py's parsers)."""
    kind = args.model
    tokens = args.seq_len if kind == "gpt" else vit_tokens(args.patch_size)
    return Model(kind, layers=args.layers, hidden=args.hidden, heads=args.heads, tokens=tokens,
                 experts=getattr(args, "experts", 0) or 0, top_k=getattr(args, "top_k", 1) or 1,
                 tied=getattr(args, "tie_embeddings", False), patch=args.patch_size, name=kind)


# ----------------------------------------------------------------------------- the field's models, as published

PRESETS = {   # kind gpt: a decoder; tokens: the training sequence; ffn: the feed-forward width
    # Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048; vocab 50257 (GPT-2's BPE)
    "gpt3-175b": Model("gpt", 96, 12288, 96, ffn=4 * 12288, vocab=50257, tokens=2048, name="GPT-3 175B"),
    # Llama 3 herd (Dubey et al. 2024), Table 3: layers, width, FFN, heads, 8 KV heads, vocab 128K, 8K context
    "llama3-8b": Model("gpt", 32, 4096, 32, 8, 14336, True, 128256, 8192, bias=False, name="Llama 3 8B"),
    "llama3-70b": Model("gpt", 80, 8192, 64, 8, 28672, True, 128256, 8192, bias=False, name="Llama 3 70B"),
    "llama3-405b": Model("gpt", 126, 16384, 128, 8, 53248, True, 128256, 8192, bias=False, name="Llama 3 405B"),
    # Jiang et al. 2024: 32 layers, 4096, 32 heads, 8 KV, FFN 14336 SwiGLU, 8 experts top-2, 32K vocab, 32K context
    "mixtral-8x7b": Model("gpt", 32, 4096, 32, 8, 14336, True, 32000, 4096, experts=8, top_k=2, bias=False,
                          name="Mixtral 8x7B"),
}


def megatron_gpt(layers, hidden, heads, name=""):
    """The GPT models of Narayanan et al. 2021 (Table 1): vocab 51,200, sequence 2,048, FFN 4h."""
    return Model("gpt", layers, hidden, heads, ffn=4 * hidden, vocab=51200, tokens=2048, name=name)


def with_tokens(m, tokens):
    return replace(m, tokens=tokens)


# ----------------------------------------------------------------------------- FLOPs


def layer_params(m):
    """(active, total) parameters of one transformer block, counted by formula (presets: no per-expert list)."""
    h, hd, f = m.hidden, m.hidden // m.heads, m.ffn_width
    attn = 2 * h * h + 2 * h * m.kv * hd + (4 * h if m.bias else 0)
    ffn = (3 if m.gated else 2) * h * f + ((f + h) if m.bias else 0)
    norms = 4 * h if m.kind in ("vit",) or m.bias else 2 * h
    router = h * m.experts if m.experts else 0
    e = max(m.experts, 1)
    return attn + norms + router + ffn * (m.top_k if m.experts else 1), attn + norms + router + ffn * e


def matmul_flops_per_token(m, causal=True):
    """Training FLOPs a token costs (forward + backward = 3 x forward): 6 x the active matmul parameters (the
    embedding lookup is no matmul, the output layer is) plus attention's scores and weighted sum, 4 s h a layer
    forward (12 s h for training), halved by a causal mask (what Megatron-LM and Llama count: the work done).
    For this project's cnn/mlp: 6 N."""
    if m.kind in ("cnn", "mlp"):
        return 6 * params_of(m)
    active, _ = layer_params(m)
    head = m.vocab * m.hidden if m.kind == "gpt" else NUM_CLASSES * m.hidden
    attention = 12 * m.tokens * m.hidden * (0.5 if causal and m.kind == "gpt" else 1)
    return 6 * (m.layers * active + head) + m.layers * attention
