"""The context-parallel flags, checked before any collective: the vit only (the one model with a
sequence), an equal run of its tokens on every rank, and under Ulysses whole heads on every rank. A bad
value is one `error:` line with the fix, exit 2 (context_parallel.py)."""
from mp.errors import fail
from mp.sizes import tokens_of


def ranks_for(degree):
    return f"{degree} ranks (torchrun --nproc-per-node {degree})"


def near_divisors(n, degree):
    """The divisors of n (above 1) nearest to degree: the largest below it and the smallest above."""
    fits = [d for d in range(2, n + 1) if n % d == 0]
    return [d for d in fits if d < degree][-1:] + [d for d in fits if d > degree][:1]


def validate_context_parallel(args, degree):
    """The degree is the world size: it must divide the vit's tokens, and under --attention ulysses its heads."""
    if args.model != "vit":
        fail(f"context parallelism splits the vit's sequence of tokens, and --model {args.model} has no "
             f"sequence: use --model vit")
    tokens = tokens_of(args)
    if tokens % degree:
        fixes = [ranks_for(d) for d in near_divisors(tokens, degree)]
        fixes += [f"--patch-size {p} ({(32 // p) ** 2} tokens)" for p in (4, 2, 1)
                  if p != args.patch_size and (32 // p) ** 2 % degree == 0][:1]
        fail(f"the vit's {tokens} tokens (--patch-size {args.patch_size}) are not divisible by the context-parallel "
             f"degree {degree}; every rank holds an equal run of tokens: use {' or '.join(fixes)}")
    if args.attention == "ulysses" and args.heads % degree:
        heads = [h for h in range(degree, args.hidden + 1, degree) if args.hidden % h == 0][:2]
        fixes = [f"--heads {h}" for h in heads] + [ranks_for(d) for d in near_divisors(args.heads, degree)][:1]
        fixes = fixes or [f"--hidden {args.hidden * degree} --heads {degree}"]
        fail(f"--heads {args.heads} is not divisible by the context-parallel degree {degree}; Ulysses gives each "
             f"rank whole heads of the whole sequence: use {' or '.join(fixes)}, or --attention ring")
