"""The mixture-of-experts flags and their checks, before any collective and without torch (the launchers
check every run in one process): --experts E turns the vit's feed-forward blocks into E experts behind a
router (mp.moe), --top-k, --aux-loss, --capacity-factor shape it; expert_parallel.py spreads the experts
over the ranks. A bad value is one `error:` line with the fix, exit 2."""
import math

from mp.errors import fail

# the programs that train the mixture of experts: the reference, and the lesson that spreads it
MOE_PROGRAMS = ("single_baseline", "expert_parallel", "parallel_5d")
DEFAULTS = {"top_k": 1, "aux_loss": 0.01, "capacity_factor": None}


def add_expert_flags(p):
    p.add_argument("--experts", type=int, default=0,
                   help="vit: each feed-forward block a mixture of E experts behind a learned router (0: dense)")
    p.add_argument("--top-k", type=int, choices=(1, 2), default=1,
                   help="experts per token: 1 (Switch: weighted by its router probability) or 2 (GShard: the "
                        "two probabilities renormalised)")
    p.add_argument("--aux-loss", type=float, default=0.01,
                   help="weight of the load-balancing loss E * sum_i f_i * P_i, summed over the blocks")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="an expert takes at most ceil(C * K * tokens / E) tokens, the rest pass through the "
                        "residual (Switch); default: dropless, every token reaches its K experts")


def validate_experts(args, program):
    """The flags' own values, and which programs and models take them."""
    if args.experts < 0:
        fail(f"--experts {args.experts} must be >= 0 (0: the dense vit; e.g. --experts 4)")
    if not args.experts:
        shaped = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, v in DEFAULTS.items() if getattr(args, k) != v]
        if shaped:
            fail(f"{', '.join(shaped)} shape{'s' * (len(shaped) == 1)} a mixture of experts and this run is dense "
                 f"(--experts 0); add --experts E (e.g. --experts 4), or drop {'it' if len(shaped) == 1 else 'them'}")
        return
    if program not in MOE_PROGRAMS:
        fail(f"--experts {args.experts}: {program}.py runs the dense vit only; train the mixture of experts with "
             f"single_baseline.py, expert_parallel.py or parallel_5d.py, or drop --experts")
    if args.model not in ("vit", "gpt"):
        fail(f"--experts {args.experts}: --model {args.model} has no feed-forward blocks to make experts of; "
             f"use --model vit or gpt")
    if args.top_k > args.experts:
        fail(f"--top-k {args.top_k} is more than --experts {args.experts}: a token cannot reach more experts than "
             f"there are; use --top-k {args.experts} or --experts {max(args.top_k, 2)}")
    if not (math.isfinite(args.aux_loss) and args.aux_loss >= 0):
        fail(f"--aux-loss {args.aux_loss} must be a finite number >= 0 (0: no load-balancing loss; default 0.01)")
    if args.capacity_factor is not None and not (math.isfinite(args.capacity_factor) and args.capacity_factor > 0):
        fail(f"--capacity-factor {args.capacity_factor} must be a finite number > 0 (e.g. 1.25; omit it for "
             f"dropless routing)")


def validate_expert_parallel(args, world):
    """expert_parallel.py: E/N experts a rank, and each rank its equal slice of the batch."""
    if args.model not in ("vit", "gpt"):
        fail(f"expert parallelism spreads the experts of the vit's or the gpt's feed-forward blocks, and --model "
             f"{args.model} has none: use --model vit or gpt")
    if args.experts <= 0:
        fail(f"--experts {args.experts}: expert parallelism needs a mixture of experts; use --experts {max(world, 2)}")
    if args.experts % world:
        fits = [n for n in range(1, args.experts + 1) if args.experts % n == 0]
        below, above = [n for n in fits if n < world][-1:], [n for n in fits if n > world][:1]
        fixes = [f"{n} ranks (torchrun --nproc-per-node {n})" for n in below + above]
        fail(f"--experts {args.experts} is not divisible by the {world} ranks; every rank holds E/N whole experts: "
             f"use --experts {world * max(1, args.experts // world)} or {' or '.join(fixes)}")
    if args.batch_size % world:
        fail(f"--batch-size {args.batch_size} is not divisible by the {world} ranks; each rank trains an equal slice "
             f"of the batch: use --batch-size {args.batch_size - args.batch_size % world or world}")
