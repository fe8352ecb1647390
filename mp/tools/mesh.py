"""The 5-D mesh as a picture: every group of a layout drawn on its ranks, printed (and with -o drawn as a PNG):

    python -m mp.tools.mesh                                          # run_5d.sh's layout: 8 ranks, cp 2 x tp 2, ep 2
    python -m mp.tools.mesh --world 16 --dp 2 --cp 2 --tp 2 --ep 4   # ep over cp x tp, edp over dp
    python -m mp.tools.mesh --dp 2 --pp 2 --cp 2 --tp 2 -o mesh.png  # --pp without --world: 16 ranks

The flags are parallel_5d.py's (stages = world / (dp x cp x tp)), their defaults run_5d.sh's. The layout is
checked by the program's own parser at that world size (mp.cli.parallel_5d_args: the same `error:` lines),
with any other flag of the program given here (--experts 8, --heads 8, --layers 30). The groups are
mp.mesh.lines(), the members Mesh.build gives each group (mp/mesh.py says why this order): the picture is the
program's, not worked out again here. The text is mp.mesh_picture's, which parallel_5d.py prints at start-up.
"""
import os
import sys

from mp.cli import parallel_5d_args
from mp.errors import fail
from mp.flags import HelpFormatter, OneLineParser
from mp.mesh import layout, lines
from mp.mesh_picture import ROLES, SHOWN, header, letters, mesh_text, title
from mp.tools.figure import plt, save

DEFAULTS = {"dp": 1, "cp": 2, "tp": 2, "ep": 2}   # run_5d.sh's DP CP TP EP
WORLD = 8                                          # run_5d.sh's NPROC
EXPERTS = 4                                        # run_5d.sh's EXPERTS, when --ep asks for some


def parse_args(argv=None):
    """(the tool's flags, ranks, ep): the layout checked as parallel_5d.py checks it, then --pp against it."""
    p = OneLineParser(prog="python -m mp.tools.mesh", formatter_class=HelpFormatter,
                      description="Print (and with -o, draw) every group of parallel_5d.py's mesh on its ranks.",
                      epilog="Any other flag of parallel_5d.py is checked with the layout, as the program checks it:\n"
                             "  python -m mp.tools.mesh --world 64 --dp 2 --cp 2 --tp 2 --ep 4 --layers 14")
    p.add_argument("--world", type=int, default=None, help=f"ranks ({WORLD}, or dp x pp x cp x tp with --pp)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages: world / (dp x cp x tp), given to check it")
    for axis, default in DEFAULTS.items():
        p.add_argument(f"--{axis}", type=int, default=default, help=f"parallel_5d.py's --{axis}; run_5d.sh's default")
    p.add_argument("-o", "--out", default=None, help="also draw every group into this PNG")
    args, rest = p.parse_known_args(argv)
    dp, cp, tp, ep = args.dp, args.cp, args.tp, args.ep
    for flag, value in (("--pp", args.pp), ("--world", args.world)):
        if value is not None and value < 1:
            fail(f"{flag} {value} must be a positive integer")
    if args.world is None:
        args.world = args.pp * dp * cp * tp if args.pp and min(dp, cp, tp) > 0 else WORLD
    layout_flags = [f"--{axis}={getattr(args, axis)}" for axis in DEFAULTS]
    given = {arg.split("=")[0] for arg in rest}
    if ep > 1 and not given & {"--experts", "--model"}:   # a picture needs no model: run_5d.sh's mixture
        layout_flags += ["--experts", str(ep * max(1, EXPERTS // ep))]
    at_world(args.world, parallel_5d_args, layout_flags + rest)
    stages = args.world // (dp * cp * tp)
    if args.pp is not None and args.pp != stages:
        fail(f"--pp {args.pp} does not fit --world {args.world}: parallel_5d.py runs world / (--dp {dp} x --cp {cp} x "
             f"--tp {tp}) = {stages} stages; use --pp {stages}, or --world {args.pp * dp * cp * tp}")
    return args, layout(args.world, dp, cp, tp), ep


def at_world(world, parse, argv):
    """parse(argv) as a rank of `world` ranks runs it (mp/cli.py reads torchrun's WORLD_SIZE), as check_args does."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        return parse(argv, None)
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


# ----------------------------------------------------------------------------- the PNG

PALETTE = plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]   # the strong hues, then the pale


def places(ranks):
    """{rank: (x, y)} of its box: a column of cp boxes of tp ranks a stage, a row a replica (the printed picture)."""
    dp, pp, cp, tp = ranks.shape
    x = lambda p, c, t: p * (cp * (tp + 0.4) + 0.8) + c * (tp + 0.4) + t
    return {ranks[d, p, c, t].item(): (x(p, c, t), -d) for d in range(dp) for p in range(pp)
            for c in range(cp) for t in range(tp)}


def panel(ax, ranks, at, colour, text, heading):
    """The ranks' boxes at their places, each coloured colour(rank) and labelled text(rank)."""
    dp, pp, cp, tp = ranks.shape
    for rank, (x, y) in at.items():
        ax.add_patch(plt.Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, facecolor=colour(rank), edgecolor="#333333", lw=0.6))
        ax.text(x, y, text(rank), ha="center", va="center", fontsize=7)
    for p in range(pp):   # a stage's name over its boxes, each cp rank's under it
        left, right = at[ranks[0, p, 0, 0].item()][0], at[ranks[0, p, cp - 1, tp - 1].item()][0]
        ax.text((left + right) / 2, 0.75, f"stage {p}", ha="center", fontsize=7)
        for c in range(cp * (cp > 1)):
            xs = [at[ranks[0, p, c, t].item()][0] for t in (0, tp - 1)]
            ax.text(sum(xs) / 2, 0.5, f"cp {c}", ha="center", fontsize=6, color="#555555")
    for d in range(dp):
        ax.text(-0.7, -d, f"replica {d}", ha="right", va="center", fontsize=7)
    xs = [x for x, _ in at.values()]
    ax.set_xlim(-3.0, max(xs) + 0.6)
    ax.set_ylim(-dp + 0.4, 1.1)
    ax.set_axis_off()
    ax.set_title(heading, fontsize=8, loc="left")


def draw(ranks, members, ep, out):
    """Eight panels: the ranks with their (dp, pp, cp, tp) coordinates, then each group name on the same boxes,
    a colour and a letter a group."""
    dp, pp, cp, tp = ranks.shape
    at, names = places(ranks), list(SHOWN)
    width = min(30.0, 2.5 + 0.55 * max(x for x, _ in at.values()))
    columns = 2 if width <= 12 else 1    # a wide mesh's panels one under the other
    fig, axes = plt.subplots(8 // columns, columns, figsize=(columns * width, 8 // columns * (0.9 + 0.55 * dp)))
    coords = {ranks[d, p, c, t].item(): (d, p, c, t) for d in range(dp) for p in range(pp)
              for c in range(cp) for t in range(tp)}
    panel(axes.flat[0], ranks, at, lambda r: "#EEEEEE", lambda r: f"{r}\n{','.join(map(str, coords[r]))}",
          "the ranks: rank (dp, pp, cp, tp coordinates)")
    for ax, name in zip(axes.flat[1:], names):
        group = {r: i for i, line in enumerate(members[name]) for r in line}
        panel(ax, ranks, at, lambda r: PALETTE[group[r] % len(PALETTE)], lambda r: f"{r}\n{letters(group[r])}",
              f"{title(name, members[name])}: {ROLES[name]}")
    fig.suptitle(header(ranks, ep).replace(", ep", "\nep"), fontsize=9)
    save(fig, out, {"kind": "mesh", "world": ranks.numel(), "dp": dp, "pp": pp, "cp": cp, "tp": tp, "ep": ep,
                    "groups": {name: members[name] for name in names}})


def main(argv=None):
    args, ranks, ep = parse_args(sys.argv[1:] if argv is None else argv)
    members = lines(ranks, ep)
    print(mesh_text(ranks, members, ep))
    if args.out:
        draw(ranks, members, ep, args.out)


if __name__ == "__main__":
    main()
