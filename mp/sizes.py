"""What the flags' checks need to know about the models and their splits, without torch: how many
blocks a model has, how many tokens the vit reads, the activations by name, and how n things split
into parts. mp.models, mp.tp and the flags (mp/cli.py, which the launchers run before anything
imports torch) all read them here, so the checks and the models cannot disagree."""

ACTIVATION_NAMES = ("gelu", "relu")   # mp.models.ACTIVATIONS: the module of each
VIT_PATCH = 4                         # --patch-size's default
VOCAB = 256                           # the gpt's symbols: bytes, no tokenizer


def vit_tokens(patch=VIT_PATCH):
    """The vit's sequence length: (32 / patch)^2 patches of a 32x32 image (mp.models.PatchEmbed)."""
    return (32 // patch) ** 2


VIT_TOKENS = vit_tokens()             # at the default patch: 64 tokens
EVAL_BATCH = 500                      # the test split goes through the model in chunks of this many samples
                                      # (mp.loop.evaluate; CIFAR-10's 10,000 and the synthetic 2,000 split evenly)


def tokens_of(args):
    """A sample's tokens: the gpt's --seq-len, the vit's at this run's --patch-size (hand-made args
    without the flag: the default)."""
    if getattr(args, "model", None) == "gpt":
        return args.seq_len
    return vit_tokens(getattr(args, "patch_size", VIT_PATCH))


def num_blocks(args):
    """The blocks a pipeline stage is made of: the cnn's 5, the mlp's Linear layers, the vit's
    transformer blocks plus its patch embedding and its head, the gpt's plus its token embedding and head."""
    return {"cnn": 5, "mlp": args.layers, "vit": args.layers + 2, "gpt": args.layers + 2}[args.model]


def split_sizes(n, parts):
    """torch.tensor_split's shard sizes: the first n % parts shards get one more (6 over 4: 2, 2, 1, 1)."""
    return [n // parts + (r < n % parts) for r in range(parts)]
