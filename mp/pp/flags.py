"""The pipeline programs' own flags and their arithmetic, checked from the flags and WORLD_SIZE alone,
before any collective: every mistake is one `error:` line that states the numbers and a fix that
works (pipeline_microbatch.py, pipeline_dp_joint.py and parallel_3d.py share them). No torch: the
launchers run these checks before anything imports it (mp/cli.py)."""
from mp.errors import fail
from mp.pp.schedules import SCHEDULES
from mp.sizes import num_blocks, split_sizes


def add_pipeline_flags(p):
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per global batch (per replica)")
    p.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="interleaved only: model chunks per rank (default: 2; always 1 for the other schedules)")
    p.add_argument("--balance", default=None,
                   help="blocks per stage (per chunk when interleaved or zbv), e.g. 2,1,1,1; auto: the split whose "
                        "slowest stage (zbv: rank, its two chunks summed) has the fewest flops, counted per block "
                        "(mp/pp/balance.py) (default: even)")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each microbatch's stage input between its forward and its backward, and "
                        "re-run the forward just before the backward (GPipe's re-materialisation)")
    p.add_argument("--check", action="store_true",
                   help="one step on the first batch against the full model in this process; exit 0 on match")
    return p


def validate_pipeline(args, stages, replicas, tp=1):
    """Arithmetic of the split, checked from flags and WORLD_SIZE alone: no collective yet.
    tp: ranks per stage (parallel_3d.py), only for the rank counts the messages suggest."""
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in ("interleaved", "zbv") else 1
    elif args.schedule == "zbv" and args.virtual_stages != 2:
        fail(f"--schedule zbv places exactly 2 chunks on each rank, in a V (rank r holds virtual stages r and "
             f"2p-1-r), not --virtual-stages {args.virtual_stages}; use --virtual-stages 2 or --schedule interleaved")
    elif args.schedule not in ("interleaved", "zbv") and args.virtual_stages != 1:
        fail(f"--virtual-stages {args.virtual_stages} applies only to --schedule interleaved, not "
             f"{args.schedule}; drop it or use --schedule interleaved")
    m, chunks = args.microbatches, stages * args.virtual_stages
    if m <= 0:
        fail(f"--microbatches {m} must be a positive integer")
    if args.batch_size % (replicas * m):
        by = f"--microbatches {m}" if replicas == 1 else f"{replicas} replicas x --microbatches {m}"
        fail(f"--batch-size {args.batch_size} is not divisible by {by}; "
             f"use --batch-size {' or --batch-size '.join(map(str, near_multiples(args.batch_size, replicas * m)))}")
    if args.schedule == "interleaved":
        if stages == 1:   # chunk a would send to chunk b on the same rank: a message to itself
            fail("--schedule interleaved needs at least 2 stages (processes); with one, use --schedule "
                 "1f1b or gpipe (the same computation, no messages)")
        if args.virtual_stages < 1:
            fail(f"--virtual-stages {args.virtual_stages} must be a positive integer")
        if m % stages:
            near = [f"--microbatches {k}" for k in near_multiples(m, stages)]
            fail(f"--schedule interleaved needs --microbatches a multiple of the {stages} stages, got {m}; "
                 f"use {' or '.join(near)}, or --schedule 1f1b (without --virtual-stages)")
    if args.schedule == "2bw":
        validate_pipedream(args, stages)
    if args.balance == "auto":   # the program turns it into the list by counting flops (mp.pp.balance.resolve_balance)
        if chunks > num_blocks(args):
            fail(too_few_blocks(args, stages, replicas * tp))
    elif args.balance is not None:
        try:
            balance = [int(b) for b in args.balance.split(",")]
        except ValueError:
            fail(f"--balance {args.balance!r} must be comma-separated integers, e.g. 2,1,1,1, or auto")
        if len(balance) != chunks or min(balance) < 1 or sum(balance) != num_blocks(args):
            if chunks > num_blocks(args):   # no list can do: fewer chunks or more blocks
                fail(too_few_blocks(args, stages, replicas * tp))
            even = ",".join(map(str, split_sizes(num_blocks(args), chunks)))
            fail(f"--balance {args.balance} must give {chunks} positive block counts summing to the "
                 f"{num_blocks(args)} blocks of the {args.model}; use --balance {even} or --balance auto")
    elif chunks > num_blocks(args):
        fail(too_few_blocks(args, stages, replicas * tp))


def validate_pipedream(args, stages):
    """2bw keeps two weight versions: enough only when every microbatch in flight on a stage
    belongs to this batch or the next, which needs m >= p (schedules.pipedream_units)."""
    m = args.microbatches
    if m < stages:
        fail(f"--schedule 2bw needs --microbatches at least the {stages} stages (two weight versions "
             f"cover a batch and the next only then), got {m}; use --microbatches {stages}")
    if args.check:
        fail("--schedule 2bw does not take --check: its steps overlap (the next batch starts before this "
             "one's update), so no step stands alone to compare with the full model; compare its losses with "
             "single_baseline.py --delay 1 instead (bash run_pipeline.sh with SCHEDULE=2bw draws both)")


def refuse_pipedream(args, program):
    """parallel_3d.py does not run 2bw: its second weight version would be plain tensors, which
    the tensor-parallel replicas' sums and averages (mp/replicas.py), made from the module's
    parameters, never see."""
    if args.schedule == "2bw":
        fail(f"--schedule 2bw runs in pipeline_microbatch.py and pipeline_dp_joint.py, not {program}.py; use "
             f"--schedule 1f1b here, or 2bw with one of those")


def near_multiples(n, k):
    """The multiples of k just below and just above n (the one below only if positive)."""
    return sorted({max(k, n // k * k), (n // k + 1) * k})


def too_few_blocks(args, stages, replicas):
    """The message for more model chunks than blocks, with fixes that each work on their own."""
    v, n = args.virtual_stages, num_blocks(args)
    what = f"{stages} pipeline stages" if v == 1 else f"{stages} stages x {v} virtual stages = {stages * v} chunks"
    if v == 1:
        fixes = [f"{n * replicas} ranks (torchrun --nproc-per-node {n * replicas})"]
    else:   # fewer ranks would break the interleaved microbatch rule: change the chunks instead
        fixes = [f"--virtual-stages {n // stages}" if n // stages >= 2
                 else "--schedule 1f1b (without --virtual-stages)"]
    depth = {"cnn": "--model vit --layers", "mlp": "--layers", "vit": "--layers", "gpt": "--layers"}[args.model]
    fixes.append(f"{depth} {stages * v - (0 if args.model == 'mlp' else 2)}")   # the vit and the gpt add 2 blocks
    return (f"{what} but the {args.model} has only {n} blocks (one chunk needs at least one); "
            f"use {' or '.join(fixes)}")


def validate_zero(args, dp):
    """--zero 1, 2 and 3 (mp.zero, mp.param_shards) need replicas to split the state over, and steps that stand alone."""
    if not args.zero:
        return
    z = f"--zero {args.zero}"
    if dp == 1:
        what = "the optimizer state" + {1: "", 2: " and the gradients", 3: ", the gradients and the weights"}[args.zero]
        fail(f"{z} splits {what} over the data-parallel replicas, and --dp 1 has one replica; use --dp 2 or more "
             "(the world size a multiple of it), or drop --zero")
    if args.schedule == "2bw":
        fail(f"{z} does not run with --schedule 2bw (2bw steps two weight versions in turn, each with its own "
             "buckets of state, and averages its gradients after the backward, not in buckets); use --schedule 1f1b, "
             "or drop --zero")


def validate_tied_zero(args):
    """--tie-embeddings with --zero 3 under zbv, whose rank 0 holds the embedding and the head in two chunks: --zero 3
    gathers a block's weights as one flat tensor and frees them after the block, and one weight in two blocks'
    tensors has no such home (mp.pp.tied). (Every chunk on one stage, the other way to hold both, is refused.)"""
    if args.model == "gpt" and args.tie_embeddings and getattr(args, "zero", 0) == 3 and args.schedule == "zbv":
        fail("--tie-embeddings with --zero 3 and --schedule zbv: zbv's rank 0 holds the embedding and the head in two "
             "chunks, which share the tied weight, and --zero 3 gathers each block's weights apart; use --zero 2, or "
             "--schedule 1f1b (the first and the last stage then sum the weight's gradients)")
