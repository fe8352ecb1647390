"""Each program's command line: its own flags on top of mp.flags.base_parser, and every check that
needs only the flags and the world size, which torchrun gives each rank as WORLD_SIZE. No torch, so
a launcher checks every run it will start, in one process and before anything imports torch, the way
each rank will check it (python -m mp.tools.check_args); each program's parse_args runs the same
function first, then the checks that need torch (a checkpoint's files, --balance auto's counted flops).

A mistake is one `error:` line with the numbers and a fix that works, and exit status 2 (mp.errors.fail).
"""
import argparse
import os
from functools import partial

from mp.cp.flags import add_cp_layout_flag, validate_context_parallel, validate_cp_layout
from mp.ep.flags import validate_expert_parallel
from mp.errors import fail
from mp.flags import add_bucket_flag, base_parser, validate_common
from mp.pp.flags import (add_pipeline_flags, near_multiples, refuse_pipedream, validate_pipeline, validate_tied_zero,
                         validate_zero)
from mp.sizes import tokens_of
from mp.tp.flags import validate_degree, validate_hybrid, validate_sequence_parallel


def world_size():
    """The number of ranks torchrun started (1 under plain python)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def add_check_flag(p):
    p.add_argument("--check", action="store_true",
                   help="one step on the first batch against the full model in this process; exit 0 on match")


def baseline_args(argv, doc):
    p = base_parser(doc)
    p.add_argument("--delay", type=int, choices=(0, 1), default=0,
                   help="1: PipeDream-2BW's rule, the reference of pipeline_microbatch.py --schedule 2bw: "
                        "step t's gradient is taken at the weights before the previous update")
    p.add_argument("--microbatches", type=int, default=1,
                   help="--experts: route each of M equal microbatches of the batch on its own (its load-balancing "
                        "loss, capacity and order), as a pipeline does; changes nothing in a dense model")
    args = p.parse_args(argv)
    validate_common(args, "single_baseline")
    if world_size() != 1:
        fail("single_baseline.py runs in one process; launch it with python, or torchrun --nproc-per-node 1")
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        divisors = [m for m in range(1, args.batch_size + 1) if args.batch_size % m == 0]
        near = sorted(divisors, key=lambda m: abs(m - args.microbatches))[:2]
        fail(f"--microbatches {args.microbatches} must be a positive divisor of --batch-size {args.batch_size} "
             f"(microbatch m is samples m*B/M .. (m+1)*B/M - 1): use --microbatches "
             f"{' or '.join(map(str, sorted(near)))}")
    return args


def pipeline_args(argv, doc):
    p = add_pipeline_flags(base_parser(doc))
    p.add_argument("--timeline", default=None, help="write the last step's measured schedule (Chrome trace)")
    args = p.parse_args(argv)
    validate_common(args, "pipeline_microbatch")
    validate_pipeline(args, stages=world_size(), replicas=1)
    return args


def joint_args(argv, doc):
    p = add_bucket_flag(add_pipeline_flags(base_parser(doc)))
    p.add_argument("--dp", type=int, default=2, help="data-parallel pipelines; stages = world size / dp")
    p.add_argument("--timeline", default=None, help="replica 0's measured schedule of the last step")
    p.set_defaults(microbatches=3, batch_size=72)   # 72 = 2 pipelines x 3 microbatches x 12 samples
    p.epilog = ("Defaults that differ from pipeline_microbatch.py's: --microbatches 3 (not 4) and\n"
                "--batch-size 72 (not 64), so that 2 pipelines x 3 microbatches divide the batch.")
    args = p.parse_args(argv)
    validate_common(args, "pipeline_dp_joint")
    world = world_size()
    if args.dp <= 0 or world % args.dp:
        fixes = [f"--dp {d}" for d in range(2, world + 1) if world % d == 0][:2]
        if args.dp > 0:
            n = args.dp * 3
            fixes.append(f"{n} ranks (torchrun --nproc-per-node {n}: {args.dp} pipelines of 3 stages)")
        fail(f"the world size {world} is not divisible by --dp {args.dp}: launch dp x stages processes; "
             f"use {' or '.join(fixes)}")
    validate_pipeline(args, stages=world // args.dp, replicas=args.dp)
    validate_zero(args, args.dp)
    validate_tied_zero(args)
    return args


def tensor_parallel_args(argv, doc):
    p = base_parser(doc)
    add_check_flag(p)
    p.add_argument("--hybrid", action="store_true",
                   help="cnn: convolutions data-parallel on slices of the batch, fc layers tensor-parallel")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="vit, gpt: LayerNorms, dropouts and residual adds on 1/degree of the tokens per rank")
    args = p.parse_args(argv)
    validate_common(args, "tensor_parallel")
    degree = world_size()
    if args.sequence_parallel:
        validate_sequence_parallel(args, degree)
    validate = validate_hybrid if args.hybrid else validate_degree
    validate(args, degree)
    return args


def context_parallel_args(argv, doc):
    """context_parallel.py: the vit or the gpt; --attention, --cp-layout, --check; the degree is the world size."""
    p = base_parser(doc)
    p.set_defaults(model="vit")   # the image model with a sequence to split (the gpt: --model gpt)
    p.add_argument("--attention", choices=["ring", "ulysses"], default="ring",
                   help="ring: key/value blocks passed around the ranks (isend/irecv); ulysses: all-to-all from a "
                        "token shard to a head shard and back")
    add_cp_layout_flag(p)
    add_check_flag(p)
    args = p.parse_args(argv)
    validate_common(args, "context_parallel")
    validate_context_parallel(args, world_size())
    return args


def expert_parallel_args(argv, doc):
    """expert_parallel.py: the vit with --experts (default 4), --check; E/N experts on each of the N ranks."""
    p = base_parser(doc)
    p.set_defaults(model="vit", experts=4)   # the one model with feed-forward blocks to make experts of
    hide_flags(p, "--zero", "--zero3-gather")   # refused below: --help lists only what the program runs
    add_check_flag(p)
    args = p.parse_args(argv)
    # before the common checks: these would name the --experts 4 default, or a data-parallel axis
    # that the experts' ranks are, as the reason
    if args.model not in ("vit", "gpt"):
        fail(f"expert_parallel.py trains the vit or the gpt, whose feed-forward blocks become the experts, and "
             f"--model {args.model} has none: drop --model, or use --model vit or gpt")
    if args.zero or args.zero3_gather:
        given = f"--zero {args.zero}" if args.zero else f"--zero3-gather {args.zero3_gather}"
        fail(f"{given}: expert_parallel.py keeps its optimizer state whole (each expert's already lives on one "
             f"rank; the lesson is the route, the dispatch and the combine); drop it, or run ZeRO in "
             f"pipeline_dp_joint.py or parallel_3d.py")
    validate_common(args, "expert_parallel")
    validate_expert_parallel(args, world_size())
    return args


def hide_flags(p, *flags):
    """Leave flags the program refuses out of its --help (the parser still reads them, to refuse them)."""
    for action in p._actions:
        if set(action.option_strings) & set(flags):
            action.help = argparse.SUPPRESS


def grid_args(argv, doc):
    """parallel_3d.py: the pipeline flags, and the grid's --dp and --tp."""
    p = add_bucket_flag(add_pipeline_flags(base_parser(doc)))
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas; stages = world size / (dp x tp)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per stage (the innermost axis)")
    p.add_argument("--timeline", default=None, help="replica 0, tp rank 0's measured schedule of the last step")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="vit, gpt: LayerNorms, dropouts, residual adds and the pipeline cuts on 1/tp of the tokens "
                        "per rank")
    p.add_argument("--scatter-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="a cut whose activation is whole on every tp rank: each sends 1/tp of it, the receivers "
                        "all-gather (Narayanan et al. 2021, section 4.1)")
    args = p.parse_args(argv)
    validate_common(args, "parallel_3d")
    refuse_pipedream(args, "parallel_3d")
    world = world_size()
    validate_grid(args, world)
    validate_degree(args, args.tp, use_degree=partial(tp_fix, args, world))
    if args.sequence_parallel:
        validate_sequence_parallel(args, args.tp, use_degree=partial(tp_fix, args, world))
    validate_pipeline(args, stages=world // (args.dp * args.tp), replicas=args.dp, tp=args.tp)
    validate_zero(args, args.dp)
    validate_tied_zero(args)
    return args


def validate_grid(args, world):
    """world = dp x pp x tp: the grid must tile the ranks exactly."""
    if args.dp <= 0 or args.tp <= 0:
        fail(f"--dp {args.dp} and --tp {args.tp} must be positive integers")
    ranks_per_stage_column = args.dp * args.tp
    if world % ranks_per_stage_column:
        fixes = [f"{n} ranks (torchrun --nproc-per-node {n})" for n in near_multiples(world, ranks_per_stage_column)]
        fixes += [f"--dp {d} --tp {t}" for d in range(args.dp, 0, -1) for t in range(args.tp, 0, -1)
                  if world % (d * t) == 0 and d * t > 1][:1]
        fail(f"the world size {world} is not divisible by --dp {args.dp} x --tp {args.tp} = {ranks_per_stage_column}: "
             f"launch dp x stages x tp processes; use {' or '.join(fixes)}")


def tp_fix(args, world, tp):
    """How to ask for tp ranks per stage: the same replicas and stages, so the world size follows."""
    n = args.dp * (world // (args.dp * args.tp)) * tp
    return f"--tp {tp} with {n} ranks (torchrun --nproc-per-node {n})"


# each program's parser by the program's name (mp.tools.check_args reads a program's docstring from its file)
PARSERS = {"single_baseline": baseline_args, "pipeline_microbatch": pipeline_args, "pipeline_dp_joint": joint_args,
           "tensor_parallel": tensor_parallel_args, "parallel_3d": grid_args, "context_parallel": context_parallel_args,
           "expert_parallel": expert_parallel_args}


def parallel_5d_args(argv, doc):
    """parallel_5d.py: --dp --cp --tp [--ep], stages = world / (dp x cp x tp); the pipeline flags,
    --sequence-parallel, --attention, --cp-layout; the vit or the gpt, dense or with --experts. Every check runs
    here, before any collective: the sizes that must divide, and the combinations not yet exact (refused, with
    the fix)."""
    p = add_bucket_flag(add_pipeline_flags(base_parser(doc)))
    p.set_defaults(model="vit")   # a model with a sequence (cp) and feed-forward blocks (experts); or --model gpt
    for axis, help_ in (("dp", "data-parallel replicas"), ("cp", "context-parallel ranks: each holds S/cp tokens"),
                        ("tp", "tensor-parallel ranks per stage (the innermost axis)"),
                        ("ep", "expert-parallel ranks, folded over a stage's dp x cp x tp ranks (divides it)")):
        p.add_argument(f"--{axis}", type=int, default=1, help=help_)
    p.add_argument("--attention", choices=["ring", "ulysses"], default="ring",
                   help="context parallelism's attention over the tokens of every cp rank (on my tp rank's heads)")
    add_cp_layout_flag(p)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="norms, dropouts, residual adds and the pipeline cuts on 1/tp of my tokens")
    p.add_argument("--scatter-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="a cut whose activation is whole on every tp rank: each sends 1/tp of it")
    p.add_argument("--timeline", default=None, help="rank 0's measured schedule of the last step")
    args = p.parse_args(argv)
    validate_common(args, "parallel_5d")
    refuse_pipedream(args, "parallel_5d")
    validate_mesh_5d(args, world_size())
    return args


def validate_mesh_5d(args, world):
    """The issue's bad input, each with its numbers and a fix, then what is not yet exact."""
    d, c, t, n = args.dp, args.cp, args.tp, args.ep
    if min(d, c, t, n) <= 0:
        fail(f"--dp {d} --cp {c} --tp {t} --ep {n} must be positive integers")
    if world % (d * c * t):
        fixes = [f"{k} ranks (torchrun --nproc-per-node {k})" for k in near_multiples(world, d * c * t)]
        fail(f"the world size {world} is not divisible by --dp {d} x --cp {c} x --tp {t} = {d * c * t}: launch "
             f"dp x cp x tp x stages processes; use {' or '.join(fixes)}")
    if (d * c * t) % n:
        fits = [k for k in range(1, d * c * t + 1) if (d * c * t) % k == 0]
        fail(f"--ep {n} does not divide --dp {d} x --cp {c} x --tp {t} = {d * c * t}: the experts are folded over a "
             f"stage's dp x cp x tp ranks; use --ep {' or --ep '.join(map(str, fits[-2:]))}")
    if args.model not in ("vit", "gpt"):   # transformers: their heads, tokens and feed-forward blocks
        fail(f"parallel_5d.py trains the vit or the gpt, whose blocks every axis cuts (their heads, tokens and "
             f"feed-forward blocks), and --model {args.model} has none of them: drop --model, or use --model vit")
    if n > 1 and not args.experts:
        fail(f"--ep {n} spreads the experts of a mixture of experts, and this run is dense; add --experts "
             f"{2 * n} (a multiple of --ep), or drop --ep")
    if args.experts and args.experts % n:
        fail(f"--experts {args.experts} is not divisible by --ep {n}; every ep rank holds E/ep whole experts: use "
             f"--experts {n * max(1, args.experts // n)}")
    validate_degree(args, t, use_degree=lambda k: f"--tp {k}")
    validate_cp_layout(args, c)   # the gpt: the sequence in the layout's equal chunks (2C zigzag, C contiguous)
    heads_per_cp = args.heads // t
    if args.attention == "ulysses" and heads_per_cp % c:
        fail(f"--heads {args.heads} is not divisible by --tp {t} x --cp {c} = {t * c}: Ulysses swaps my tp rank's "
             f"{heads_per_cp} heads for all tokens, {c} ways; use --heads {t * c * max(1, args.heads // (t * c))} "
             f"(--hidden divisible by it) or --attention ring")
    if args.model == "vit":
        tokens, split = tokens_of(args), c * t if args.sequence_parallel else c
        if tokens % split:
            what = f"--cp {c} x --tp {t} = {split} (--sequence-parallel)" if args.sequence_parallel else f"--cp {c}"
            fail(f"the vit's {tokens} tokens (--patch-size {args.patch_size}) are not divisible by {what}; every "
                 f"rank holds an equal run of tokens: use a --cp that divides {tokens}, or --patch-size 2")
    if args.model == "gpt":
        validate_gpt_5d(args, c, t)
    if args.sequence_parallel:
        validate_sequence_parallel(args, t, use_degree=lambda k: f"--tp {k}")
    elif args.experts and t > 1 and (tokens_of(args) // c) % t:
        fail(f"--experts with --tp {t}: each tp rank routes an equal run of my cp rank's {tokens_of(args) // c} tokens "
             f"(the {args.model}'s {tokens_of(args)} / --cp {c}), and {t} does not divide them; use a --tp that "
             f"divides {tokens_of(args) // c}")
    stages = world // (d * c * t)
    validate_pipeline(args, stages=stages, replicas=d, tp=c * t)
    if args.zero:
        validate_zero(args, d * c)


def validate_gpt_5d(args, c, t):
    """The gpt on the 5-D mesh: under --sequence-parallel my cp rank's S/C tokens split into T equal runs; with
    --capacity-factor the experts' order is the baseline's per (sample, cp chunk, tp run), which the zigzag's two
    chunks a rank do not keep (not yet exact: refused)."""
    if args.sequence_parallel and args.seq_len % (c * t):
        n = c * t
        fail(f"--seq-len {args.seq_len} is not divisible by --cp {c} x --tp {t} = {n} (--sequence-parallel): every "
             f"rank holds an equal run of its cp rank's tokens; use --seq-len {args.seq_len // n * n + n}"
             + (f" or {args.seq_len // n * n}" if args.seq_len >= n else ""))
    if args.capacity_factor is not None and c > 1 and args.cp_layout == "zigzag":
        fail(f"--capacity-factor with --cp {c} --cp-layout zigzag: which tokens an expert drops follows the baseline's "
             f"order of the tokens, and a zigzag rank holds two chunks apart; use --cp-layout contiguous, or drop "
             f"--capacity-factor (dropless)")


PARSERS["parallel_5d"] = parallel_5d_args
