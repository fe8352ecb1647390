"""The planned schedule of a pipeline, printed as a clock table (and with -o drawn as a PNG):

    python -m mp.tools.schedule --schedule zb --stages 4 --microbatches 4
    python -m mp.tools.schedule --schedule zbv --stages 4 --microbatches 8
    python -m mp.tools.schedule --schedule interleaved --stages 4 --microbatches 8 --virtual-stages 2 -o plan.png

The tables are mp.pp.schedules' clock_table; the drawing is mp.tools.plot_timeline's, which also draws
the planned chart beside each measured timeline (python -m mp.tools.plot_curves --timeline, as
run_pipeline.sh calls it).
"""
import argparse
import sys

from mp.pp.schedules import SCHEDULES, clock_cells, clock_table
from mp.tools import plot_timeline


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Print (and with -o, draw) the planned clock table of a schedule.",
                                epilog="e.g. python -m mp.tools.schedule --schedule interleaved --stages 4 --microbatches 4 "
                                       "--virtual-stages 2 -o interleaved.png")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages p (ranks)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches m per step")
    p.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank (interleaved: default 2; zbv: 2)")
    p.add_argument("-o", "--out", default=None, help="also draw the table into this PNG")
    args = p.parse_args(argv)
    for flag, value in (("--stages", args.stages), ("--microbatches", args.microbatches)):
        if value < 1:
            bad(f"{flag} {value} must be a positive integer")
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in ("interleaved", "zbv") else 1
    elif args.schedule == "zbv" and args.virtual_stages != 2:
        bad(f"--schedule zbv places exactly 2 chunks on each rank, in a V, not --virtual-stages {args.virtual_stages}; "
            f"use --virtual-stages 2 or --schedule interleaved")
    elif args.schedule not in ("interleaved", "zbv") and args.virtual_stages != 1:
        bad(f"--virtual-stages {args.virtual_stages} applies only to --schedule interleaved, not {args.schedule}; "
            f"drop it or use --schedule interleaved")
    if args.schedule == "2bw" and args.microbatches < args.stages:
        bad(f"--schedule 2bw needs --microbatches at least --stages {args.stages}, got {args.microbatches}; "
            f"use --microbatches {args.stages}")
    if args.schedule == "interleaved":
        p_, m = args.stages, args.microbatches
        if p_ < 2:
            bad("--schedule interleaved needs at least 2 stages; with one, use --schedule 1f1b")
        if args.virtual_stages < 1:
            bad(f"--virtual-stages {args.virtual_stages} must be a positive integer")
        if m % p_:
            bad(f"--schedule interleaved needs --microbatches a multiple of --stages {p_}, got {m}; "
                f"use --microbatches {(m // p_ + 1) * p_}" + (f" or {m // p_ * p_}" if m > p_ else ""))
    return args


def bad(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def describe(schedule, p, m, v):
    """The heading of a printed or drawn table: the sizes, the ticks and the bubble of the formula
    (plot_timeline.plan_title, which also heads the planned chart beside each measured timeline)."""
    return plot_timeline.plan_title(schedule, p, m, v)


def main(argv=None):
    args = parse_args(argv)
    s, p, m, v = args.schedule, args.stages, args.microbatches, args.virtual_stages
    print(describe(s, p, m, v))
    print("\n".join(clock_table(s, p, m, v)))
    if args.out:
        plot_timeline.plot_clock_table(clock_cells(s, p, m, v), describe(s, p, m, v), args.out)


if __name__ == "__main__":
    main()
