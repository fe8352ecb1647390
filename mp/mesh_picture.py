"""The mesh as text: the ranks by stage, each group drawn on them, and what a pipeline message carries.
parallel_5d.py prints start_up() on rank 0; python -m mp.tools.mesh prints mesh_text() (and draws it) for any
layout. Everything is read off mp.mesh's layout() and lines(), the members Mesh.build gives its groups, so
the picture is the program's: nothing here works a group out again.

    replica 0:  [ 0 | 1 ] [ 2 | 3 ] --> [ 4 | 5 ] [ 6 | 7 ]      a row a replica (dp), a column of boxes
                                                                 a stage (pp), a box a cp rank, | between tp ranks
"""
from mp.sizes import tokens_of

# every group of mp.mesh, the most talkative first (mp/mesh.py's docstring), with what runs on it
ROLES = {
    "tp": "tensor parallel: a stage's layers split; collectives in every layer",
    "cp": "context parallel: each sequence split; the ring or Ulysses' all-to-alls in every attention",
    "pp": "a pipeline: activations and their gradients point to point, stage to stage",
    "dp": "data parallel: a stage's replicas at one cp and tp coordinate",
    "dp_cp": "holding the same dense weights: their gradients' all-reduce (ZeRO: its shards), the loss",
    "ep": "expert parallel: every MoE layer's all-to-alls (dispatch, combine), over dp x cp x tp",
    "edp": "expert data parallel: the ranks with the same experts: their gradients' all-reduce",
}
SHOWN = tuple(ROLES)
WIDE = 100       # a listing of groups wraps at this width
PICTURED = 64    # start_up draws the ranks up to this many (a row a replica grows with pp x cp x tp)


def label(name):
    return "dp x cp" if name == "dp_cp" else name


def letters(i):
    """A group's label: a, b, ..., z, aa, ab, ... (a spreadsheet's column names, in lower case)."""
    name = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        name = chr(ord("a") + r) + name
    return name


def header(ranks, ep):
    dp, pp, cp, tp = ranks.shape
    world = ranks.numel()
    return (f"mesh: {world} ranks = arange({world}).view(dp {dp}, pp {pp}, cp {cp}, tp {tp}) (mp/mesh.py), "
            f"ep {ep} over each stage's dp x cp x tp = {dp * cp * tp} ranks")


def picture(ranks, cell=str, heads=True):
    """The ranks by stage, as mp/mesh.py's docstring draws them; cell(rank) is what each rank's place shows."""
    dp, pp, cp, tp = ranks.shape
    width = max(len(str(r)) for r in (ranks.numel() - 1, *map(cell, range(ranks.numel()))))   # as wide as the ranks
    box = lambda d, p, c: "[" + "|".join(f" {cell(ranks[d, p, c, t].item()):>{width}} " for t in range(tp)) + "]"
    column = len(box(0, 0, 0))
    stage = column * cp + cp - 1
    margin = " " * len(f"replica {dp - 1}:  ")
    titles = [margin + "     ".join(f"stage {p} (pp {p})".center(stage) for p in range(pp)).rstrip()]
    if cp > 1:
        boxes = " ".join(f"cp {c}".center(column) for c in range(cp))
        titles.append(margin + "     ".join([boxes] * pp).rstrip())
    rows = [f"replica {d}:".ljust(len(margin)) + " --> ".join(" ".join(box(d, p, c) for c in range(cp))
                                                              for p in range(pp)) for d in range(dp)]
    return (titles if heads else []) + rows


def group_text(ranks, name, members):
    """One group name: a line saying what runs on it, the picture with each rank's group lettered, the letters."""
    of = {r: letters(i) for i, line in enumerate(members) for r in line}
    listed = [f"{letters(i)} {{{','.join(map(str, line))}}}" for i, line in enumerate(members)]
    rows, row = [], "  "
    for item in listed:
        if len(row) + len(item) > WIDE and row.strip():
            rows, row = rows + [row.rstrip()], "  "
        row += item + "  "
    return [f"{title(name, members)} ({ROLES[name]})"] + picture(ranks, lambda r: of[r], heads=False) + rows + \
        [row.rstrip()]


def title(name, members):
    """e.g. "tp: 4 groups of 2 ranks"."""
    size = len(members[0])
    return f"{label(name)}: {len(members)} group{'s' * (len(members) > 1)} of {size} rank{'s' * (size > 1)}"


def mesh_text(ranks, members, ep):
    """Every group of a layout, each on the picture of the ranks: what python -m mp.tools.mesh prints."""
    out = [header(ranks, ep), ""] + picture(ranks)
    for name in SHOWN:
        out += [""] + group_text(ranks, name, members[name])
    return "\n".join(out)


def command(ranks, ep):
    dp, pp, cp, tp = ranks.shape
    return f"python -m mp.tools.mesh --world {ranks.numel()} --dp {dp} --cp {cp} --tp {tp} --ep {ep}"


def start_up(mesh, messenger, args):
    """What parallel_5d.py's rank 0 says before training: the mesh by axis (its picture up to PICTURED ranks), this
    rank's group of every name, and what crosses each pipeline cut per sample."""
    ranks = mesh.ranks
    out = [header(ranks, mesh.ep_size)] + (picture(ranks) if ranks.numel() <= PICTURED else [])
    mine = "  ".join(f"{label(name)} {{{','.join(map(str, mesh.peers(name)))}}}" for name in SHOWN)
    out += [f"rank {mesh.rank}'s groups: {mine}", f"every group, drawn: {command(ranks, mesh.ep_size)} [-o mesh.png]"]
    return "\n".join(out + cut_lines(messenger, mesh, args))


def cut_lines(messenger, mesh, args):
    """Two lines for the cuts that carry the same message: its numbers per sample, then what they are and who
    gathers them (the shapes are the messenger's, the ones the pipeline's buffers are made from)."""
    stages, tp = len(messenger.shapes), mesh.tp_size
    if stages == 1:
        return ["pipeline messages: none (one stage)"]
    said = {}
    for cut in range(1, stages):
        whole, sent = list(messenger.shapes[cut]), messenger.message_shape(cut)
        what = f"the activation {whole}" + meaning(whole, mesh, args)
        if cut in messenger.scattered:   # whole on every tp rank: each sends its share, the receivers gather
            what = (f"{sent} = tp rank {mesh.tp_rank}'s 1/{tp} of {what}; the receiving stage's tp group all-gathers "
                    f"the {tp} shares")
        said.setdefault(what, []).append(cut)
    where = "stage" if stages == mesh.pp_size else "virtual stage"
    across = lambda cuts: f"cut {cuts[0]} ({where} {cuts[0] - 1} -> {cuts[0]})" if len(cuts) == 1 else \
        f"cuts {', '.join(map(str, cuts))} ({where} c-1 -> c)"
    return [f"pipeline {across(cuts)}, a sample's message from rank {mesh.rank}:\n    {what}; its gradient comes "
            f"back the same way" for what, cuts in said.items()]


def meaning(shape, mesh, args):
    """The vit's [tokens, width] between blocks in the doc's symbols: my cp rank's tokens, or my tp rank's of them."""
    tokens, cp, tp = tokens_of(args), mesh.cp_size, mesh.tp_size
    if args.model != "vit" or len(shape) != 2:
        return ""
    if shape[0] == tokens // (cp * tp) and tp > 1:   # --sequence-parallel: the cut on 1/T of my cp rank's tokens
        mine = f"cp rank {mesh.cp_rank}'s {tokens // cp} tokens (of S = {tokens})" if cp > 1 else \
            f"the S = {tokens} tokens"
        return f" = [S/(C·T), H]: tp rank {mesh.tp_rank}'s {shape[0]} of {mine}, width {shape[1]}"
    if cp > 1:
        return f" = [S/C, H]: cp rank {mesh.cp_rank}'s {shape[0]} of the S = {tokens} tokens, width {shape[1]}"
    return f" = [S, H]: all {shape[0]} tokens, width {shape[1]}"
