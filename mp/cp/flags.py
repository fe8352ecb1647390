"""The context-parallel flags, checked before any collective: a model with a sequence (the vit, the gpt),
an equal run of its tokens on every rank (the gpt's zigzag: two chunks of S/2C), and under Ulysses whole
heads on every rank. A bad value is one `error:` line with the fix, exit 2 (context_parallel.py)."""
from mp.errors import fail
from mp.sizes import tokens_of


def ranks_for(degree):
    return f"{degree} ranks (torchrun --nproc-per-node {degree})"


def near_divisors(n, degree):
    """The divisors of n (above 1) nearest to degree: the largest below it and the smallest above."""
    fits = [d for d in range(2, n + 1) if n % d == 0]
    return [d for d in fits if d < degree][-1:] + [d for d in fits if d > degree][:1]


def add_cp_layout_flag(p):
    p.add_argument("--cp-layout", choices=["zigzag", "contiguous"], default=None,
                   help="gpt: zigzag (rank r holds chunks r and 2C-1-r of 2C: causal attention's work balanced; the "
                        "default) or contiguous (chunk r of C: the plain causal ring, the last rank does the most); "
                        "the vit: contiguous only")


def validate_cp_layout(args, degree):
    """--cp-layout: the gpt's causal ring (default zigzag); the vit's attention is not causal, contiguous only.
    The gpt's sequence must split into the layout's equal chunks."""
    if args.model != "gpt":
        if args.cp_layout == "zigzag":
            fail("--cp-layout zigzag balances causal attention, and the vit's is not causal (every rank's work is "
                 "equal already): drop --cp-layout, or use --model gpt")
        args.cp_layout = "contiguous"
        return
    args.cp_layout = args.cp_layout or "zigzag"
    chunks = 2 * degree if args.cp_layout == "zigzag" else degree
    if args.seq_len % chunks:
        near = sorted({args.seq_len - args.seq_len % chunks, args.seq_len + chunks - args.seq_len % chunks} - {0})
        why = (f"2 x {degree} chunks (rank r holds chunks r and {2 * degree - 1}-r)" if args.cp_layout == "zigzag"
               else f"{degree} chunks (rank r holds chunk r)")
        fail(f"--seq-len {args.seq_len} is not divisible by {chunks}: --cp-layout {args.cp_layout} at the "
             f"context-parallel degree {degree} cuts the sequence into {why}; use "
             f"{' or '.join(f'--seq-len {n}' for n in near)}")


def validate_context_parallel(args, degree):
    """The degree is the world size: it must divide the sequence's tokens (the gpt's zigzag: twice), and under
    --attention ulysses the heads."""
    if args.model not in ("vit", "gpt"):
        fail(f"context parallelism splits a sequence of tokens, and --model {args.model} has no "
             f"sequence: use --model vit or gpt")
    validate_cp_layout(args, degree)
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
