"""The tensor-parallel flags, checked before any collective: every rank needs whole heads and at
least one neuron of each split layer (the gpt: an equal slice of its vocabulary); under
--sequence-parallel an equal run of the vit's or the gpt's tokens; under --hybrid an equal slice of
the batch. A bad value is one `error:` line with the fix, exit 2 (tensor_parallel.py, and
parallel_3d.py for its --tp)."""
from mp.errors import fail
from mp.sizes import VIT_TOKENS, VOCAB


def ranks_for(degree):
    return f"{degree} ranks (torchrun --nproc-per-node {degree})"


def validate_degree(args, degree, use_degree=ranks_for):
    """Every rank needs whole heads and at least one neuron of the narrowest split layer.
    use_degree(d): how to ask for degree d (here the world size; parallel_3d.py: --tp d)."""
    if args.model == "gpt" and VOCAB % degree:   # mp.tp.vocab: my V/T rows of the embedding and the head
        fits = [d for d in range(2, degree * 2) if VOCAB % d == 0]
        near = [max(d for d in fits if d < degree)] + [d for d in fits if d > degree][:1]
        fail(f"the gpt's vocabulary of {VOCAB} bytes is not divisible by the tensor-parallel degree {degree}; each "
             f"rank holds an equal slice of the embedding and the output layer: "
             f"use {' or '.join(map(use_degree, near))}")
    if args.model in ("vit", "gpt") and args.heads % degree:   # fixes that also keep --hidden divisible by --heads
        heads = [h for h in range(degree, args.hidden + 1, degree) if args.hidden % h == 0][:2]
        ranks = [d for d in range(2, args.heads + 1) if args.heads % d == 0][:1]
        fixes = [f"--heads {h}" for h in heads] + [use_degree(d) for d in ranks]
        fixes = fixes or [f"--hidden {args.hidden * degree} --heads {degree}"]
        fail(f"--heads {args.heads} is not divisible by the tensor-parallel degree {degree}; each rank "
             f"needs whole heads: use {' or '.join(fixes)}")
    if args.model == "cnn":
        width, what = 6, "output channels of cnn conv1"
    elif args.model == "mlp" and args.layers % 2:  # the classifier is split too: 10 outputs
        width, what = min(args.hidden, 10), "neurons of the mlp's narrowest split layer"
    else:
        width, what = args.hidden, f"--hidden neurons of the {args.model}"
    if degree > width:
        fail(f"the tensor-parallel degree {degree} exceeds the {width} {what}; every rank needs at least one: "
             f"use at most {use_degree(width)}")


def validate_sequence_parallel(args, degree, use_degree=ranks_for):
    """--sequence-parallel: the vit or the gpt, and every rank holds an equal run of its tokens (the vit's 64,
    the gpt's --seq-len). use_degree(d): how to ask for degree d (here the world size; parallel_3d.py: --tp d)."""
    if getattr(args, "hybrid", False):   # parallel_3d.py has no --hybrid
        fail("--sequence-parallel shards the vit's tokens and --hybrid the cnn's batch; they do not combine: "
             "drop one of them")
    if args.model == "gpt":
        if args.seq_len % degree:
            low = args.seq_len // degree * degree
            fail(f"--seq-len {args.seq_len} is not divisible by the tensor-parallel degree {degree}; under "
                 f"--sequence-parallel every rank holds an equal run of tokens: use a multiple of {degree}, e.g. "
                 f"--seq-len {low + degree}" + (f" or {low}" if low else "") + ", or drop --sequence-parallel")
        return
    if args.model != "vit":
        fail(f"--sequence-parallel shards the vit's sequence of {VIT_TOKENS} tokens, and --model {args.model} "
             f"has no sequence: use --model vit, or drop --sequence-parallel")
    if getattr(args, "patch_size", 4) != 4:   # mp.tp.sequence splits the default 64 tokens only
        fail(f"--sequence-parallel splits the vit's {VIT_TOKENS} tokens of --patch-size 4, not --patch-size "
             f"{args.patch_size}: drop --patch-size, or use context_parallel.py, which splits any sequence")
    if VIT_TOKENS % degree:
        fits = [d for d in range(2, VIT_TOKENS + 1) if VIT_TOKENS % d == 0]
        near = [max(d for d in fits if d < degree)] + [d for d in fits if d > degree][:1]
        fail(f"the vit's {VIT_TOKENS} tokens are not divisible by the tensor-parallel degree {degree}; under "
             f"--sequence-parallel every rank holds an equal run of tokens: use {' or '.join(map(use_degree, near))}, "
             f"or drop --sequence-parallel")


def validate_hybrid(args, degree):
    """--hybrid: the cnn's batch splits evenly over the ranks, and fc3 has a neuron for every rank."""
    if args.model != "cnn":
        has = "no convolutions" if args.model == "mlp" else "only its patch embedding as a convolution"
        fail(f"--hybrid runs the cnn's convolutions data-parallel, and --model {args.model} has {has}: "
             f"use --model cnn, or drop --hybrid")
    if args.batch_size % degree:
        low = args.batch_size // degree * degree
        fail(f"--batch-size {args.batch_size} is not divisible by the tensor-parallel degree {degree}; under "
             f"--hybrid every rank runs the convolutions on an equal slice of the batch: use a multiple of "
             f"{degree}, e.g. {low + degree}" + (f" or {low}" if low else ""))
    if degree > 10:
        fail(f"the tensor-parallel degree {degree} exceeds the 10 outputs of cnn fc3; every rank needs at "
             f"least one: use at most 10 ranks")
