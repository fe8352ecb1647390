"""Checkpoints in the baseline model's coordinates, so that a run resumes in any layout.

Every layout here is a slice of one model built from one seed, and every rank names its parameters
as the baseline does (`2.1.weight`) and knows which slice of the full tensor it holds
(tensor_parallel's `shards`: dim, start, length). So each rank writes, with
torch.distributed.checkpoint (DCP), exactly what it holds, each piece under a key that says where it
sits in the full model:

    param/2.1.weight@0:0:60        rows 0..59 of fc1's weight (tp rank 0 of 2)
    param/2.1.weight@0:60:60       rows 60..119 (tp rank 1)
    momentum/2.1.weight@0:0:60     its SGD momentum buffer, the same slice
    exp_avg/2.1.weight@0:0:60      --optimizer adamw: its two running means instead, the same slice,
    exp_avg_sq/2.1.weight@0:0:60
    step/2.1.weight                and AdamW's step count, a 0-dim tensor, whole on every rank
    param/2.1.bias                 a whole tensor (a pipeline stage, a replicated tensor)
    stale/2.1.bias                 PipeDream-2BW's rule only: the weights before the last update
    exp_avg/2.1.weight#0:5040:120x84       --zero: a replica's slice of a flat bucket, elements 0..5039
    exp_avg/2.1.weight@0:0:60#0:2520:60x84 of the 120x84 tensor (or of the tp slice that @ names), flattened

The optimizer's state goes through mp.optim's param_state, one parameter at a time, in the parameter's
shape: whatever kinds the optimizer keeps are saved, under their names.

Replicas (data-parallel, or tp ranks holding a replicated tensor) write the same key; DCP's planner
keeps one writer per key. Under --zero each data-parallel replica writes its own slices only, the
flat ranges of each parameter that its share of a bucket holds (the `#first:count:shape` keys: a
sharded state, never the whole state gathered, ZeroOptimizer.saved_pieces).

A resume is the save's mirror: each rank makes the optimizer state it will hold (mp.optim.make_state)
and reads into what it holds now, the same list a save writes (held(): its weights, tp slices, --zero
slices), from each saved piece only the part that overlaps it (SliceReads: both are cut into boxes of
the full tensor, every overlap one read into a view of the held tensor), then --zero 1, 2 all-gather
the weights' slices as after an update. Any saved layout into any other (resharding), and nothing
whole is gathered or put together: beside what the rank holds, DCP's reader has one saved piece in memory
at a time (a replica's share of a tensor when it was saved under --zero, one tensor when it was
saved whole), and a read across another tp split of a --zero piece (not one range of it) goes through
the range that covers it. Why not DTensor: its Shard placement assumes torch.chunk's split (6 over 4
ranks: 2, 2, 2, 0), ours is tensor_split's (2, 2, 1, 1), and the vit splits by whole heads; keys that
carry the slice express any split.

A save is atomic: every rank writes into DIR/.step-K.partial, then rank 0 adds meta.json (the step,
the settings, the layout) and renames the directory to DIR/step-K. A process killed during a save
leaves only a .partial directory, which resuming ignores (and the next save of step K replaces).
"""
import json
import os
import re
import shutil

import torch
import torch.distributed as dist

from mp.dist import awaiting
from mp.errors import fail
from mp.models import shard_of
from mp.optim import loaded, make_state, param_state

# what makes a run what it is: a checkpoint resumes only into a run with the same values
SETTINGS = ("model", "layers", "hidden", "heads", "patch_size", "activation", "data", "seed", "batch_size",
            "optimizer", "lr", "momentum", "weight_decay", "beta1", "beta2", "adam_eps", "dropout", "clip_grad_norm",
            "delay", "experts", "top_k", "aux_loss", "capacity_factor", "seq_len", "tie_embeddings", "loss_mask",
            "text_file")
# a checkpoint saved before the flag existed: the value it trained with (SGD, without weight decay)
EARLIER = {"activation": "gelu", "delay": 0, "optimizer": "sgd", "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999,
           "adam_eps": 1e-8, "patch_size": 4, "experts": 0, "top_k": 1, "aux_loss": 0.01, "capacity_factor": None,
           "seq_len": 64, "tie_embeddings": False, "loss_mask": "none", "text_file": None}
WEIGHTS = ("param", "stale")                   # the other kinds of key are the optimizer's state
RULES = {0: "the synchronous update", 1: "PipeDream-2BW's update (--schedule 2bw, single_baseline.py --delay 1)"}
STEP_DIR = re.compile(r"^step-(\d{8})$")


# ----------------------------------------------------------------------------- before any collective


def validate(args):
    """Called by each program's parse_args after the flags' own checks, on every rank, before any
    collective: the directory's latest complete checkpoint (if any) is readable and of the same run
    (DCP's metadata needs torch, so the launchers' check of the flags cannot read it). Sets args.resume_from."""
    args.resume_from = None
    if args.checkpoint_dir is None:   # --save-every and a file in the way: checked with the flags (mp.flags)
        return
    path = latest(args.checkpoint_dir)
    if path is None:
        return
    meta = read_meta(path)
    saved, here = {k: meta["settings"].get(k, EARLIER.get(k)) for k in SETTINGS}, settings(args)
    differ = [f"{RULES[saved[k]]} there, {RULES[here[k]]} here" if k == "delay" else
              f"--{k.replace('_', '-')} {saved[k]} there, {here[k]} here" for k in SETTINGS if saved[k] != here[k]]
    if differ:
        fail(f"the checkpoint {path} is of another run ({'; '.join(differ)}); resume with its settings, or use "
             f"another --checkpoint-dir (nothing was deleted)")
    check_files(path)
    args.resume_from = path


def settings(args):
    """What makes a run what it is. delay: the update rule, 1 for PipeDream-2BW's gradients taken one
    update stale (pipeline_microbatch.py --schedule 2bw and single_baseline.py --delay 1, which
    resume from each other's checkpoints), else 0."""
    values = {k: getattr(args, k, None) for k in SETTINGS}
    values["delay"] = int(getattr(args, "delay", 0) == 1 or getattr(args, "schedule", None) == "2bw")
    return values


def latest(directory):
    """The complete checkpoint of the highest step (a directory step-K with meta.json), or None."""
    if not os.path.isdir(directory):
        return None
    steps = sorted(name for name in os.listdir(directory)
                   if STEP_DIR.match(name) and os.path.exists(os.path.join(directory, name, "meta.json")))
    return os.path.join(directory, steps[-1]) if steps else None


def read_meta(path):
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if not all(key in meta for key in ("step", "settings", "layout")):   # the fields a resume needs
            raise KeyError("step, settings or layout")
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"the checkpoint {path} is damaged: its meta.json cannot be read ({e}); move that directory away "
             f"to resume from the one before it (nothing was deleted)")


def dcp():
    """torch.distributed.checkpoint, imported when a run first saves or resumes: it brings DTensor
    with it, about 0.3 s of CPU per process, which every rank of every run would pay at start-up."""
    import torch.distributed.checkpoint
    return torch.distributed.checkpoint


def check_files(path):
    """DCP's metadata is readable and every byte range it names exists (a truncated file fails here)."""
    try:
        metadata = dcp().FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 (any failure to read means the same: damaged)
        fail(f"the checkpoint {path} is damaged: its DCP metadata cannot be read ({type(e).__name__}); move that "
             f"directory away to resume from the one before it (nothing was deleted)")
    for info in (metadata.storage_data or {}).values():
        file = os.path.join(path, info.relative_path)
        size = os.path.getsize(file) if os.path.exists(file) else -1
        if size < info.offset + info.length:
            fail(f"the checkpoint {path} is damaged: {info.relative_path} has {max(size, 0)} bytes, its metadata "
                 f"needs {info.offset + info.length}; move that directory away to resume from the one before "
                 f"it (nothing was deleted)")


# ----------------------------------------------------------------------------- what a rank holds


def key(kind, name, spec, flat=None):
    """flat (--zero): (first, count, shape), the elements first..first+count-1 of the tensor that spec
    names (its shape), flattened."""
    k = f"{kind}/{name}" + ("" if spec is None else "@" + ":".join(map(str, spec)))
    return k if flat is None else k + f"#{flat[0]}:{flat[1]}:" + "x".join(map(str, flat[2]))


def parse_key(k):
    """(kind, name, spec, flat) of a key (key's arguments)."""
    kind, rest = k.split("/", 1)
    rest, _, flat = rest.partition("#")
    name, _, spec = rest.partition("@")
    if flat:
        first, count, shape = flat.split(":")
        flat = (int(first), int(count), tuple(int(n) for n in shape.split("x")))
    return kind, name, tuple(map(int, spec.split(":"))) if spec else None, flat or None


def weights_of(model, versions):
    """[(name, current, stale, stepped)] per parameter: the tensor holding its current weights, the
    one holding the weights before the last update (None but under 2BW's rule), and the tensor the
    optimizer steps (its momentum's key). versions: the program's own list (single_baseline.py
    --delay 1, mp.pp.pipedream.TwoVersions), else each parameter of model, alone."""
    return versions if versions is not None else [(name, p, None, p) for name, p in model.named_parameters()]


def held(model, optimizer, versions=None):
    """[(kind, name, spec, flat, tensor)] of what this rank holds: parameters, the optimizer's state
    (SGD's momentum, AdamW's running means and step), and the stale weights under 2BW's rule. A 0-dim
    state (the step) has no slice: its spec is None. --zero: this replica's slices of them (flat, key's)."""
    if hasattr(optimizer, "saved_pieces"):
        names = {id(p): name for name, p in model.named_parameters()}
        return [(kind, names[id(p)], shard_of(model, names[id(p)]) if t.dim() else None, flat, t)
                for kind, p, flat, t in optimizer.saved_pieces(model.parameters())]
    out = []
    for name, current, stale, stepped in weights_of(model, versions):
        spec = shard_of(model, name)
        out.append(("param", name, spec, None, current))
        if stale is not None:
            out.append(("stale", name, spec, None, stale))
        for kind, t in param_state(optimizer, stepped).items():
            out.append((kind, name, spec if t.dim() else None, None, t))
    return out


# ----------------------------------------------------------------------------- save


def maybe_save(args, step, model, optimizer, layout, rank, versions=None):
    """After step `step`'s update: save when it is a multiple of --save-every, or the last."""
    if args.checkpoint_dir and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
        save(args, step + 1, model, optimizer, layout, rank, versions)


def save(args, next_step, model, optimizer, layout, rank, versions=None):
    """Every rank writes its pieces (a collective), then rank 0 commits the directory by renaming it. A peer
    lost meanwhile: one error line naming the checkpoint, after --timeout-s (the partial directory stays)."""
    final = os.path.join(args.checkpoint_dir, f"step-{next_step:08d}")
    partial = os.path.join(args.checkpoint_dir, f".step-{next_step:08d}.partial")
    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)        # a save of this step that was killed
    with awaiting(f"rank {rank} waited for every rank's part of the checkpoint {final}", args.timeout_s):
        dist.barrier()
        # --zero: each replica writes its slices, nothing gathered (--zero 3's weights included)
        state = {key(kind, name, spec, flat): t.detach()
                 for kind, name, spec, flat, t in held(model, optimizer, versions)}
        dcp().save(state, checkpoint_id=partial)
        del state
        dist.barrier()                                   # every rank's pieces are written
        if rank == 0:
            meta = {"step": next_step, "settings": settings(args), "layout": layout}
            with open(os.path.join(partial, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(final):                    # a run that went back to an earlier step
                shutil.rmtree(final)
            os.rename(partial, final)                    # the commit: atomic on one file system
        dist.barrier()


# ----------------------------------------------------------------------------- load


def resume(args, model, optimizer, rank, versions=None):
    """Load args.resume_from into this rank's parameters and optimizer state, and stale weights under
    2BW's rule (a collective); returns (the step to run next, the layout that wrote it), or (0, None).
    Each tensor this rank holds (held(), what a save writes: --zero, its slices) is read straight into
    place from the parts of the saved pieces that overlap it; --zero 1, 2 then all-gather the weights'
    slices, as after an update. Nothing whole is gathered or put together."""
    if not args.resume_from:
        return 0, None
    meta = read_meta(args.resume_from)
    saved = {}                                           # (kind, name) -> [(key, spec, flat, shape, chunk offsets)]
    for k, md in dcp().FileSystemReader(args.resume_from).read_metadata().state_dict_metadata.items():
        kind, name, spec, flat = parse_key(k)
        saved.setdefault((kind, name), []).append((k, spec, flat, tuple(md.size), md.chunks[0].offsets))
    # the optimizer's state of the kinds saved (validate() matched the optimizer; none before the first
    # step), made as its step would make it, to be read into
    kinds = {}
    for kind, name in saved:
        if kind not in WEIGHTS:
            kinds.setdefault(name, []).append(kind)
    make_state(optimizer, [(stepped, kinds.get(name, [])) for name, _, _, stepped in weights_of(model, versions)])
    reads = SliceReads(args.resume_from)
    for kind, name, spec, flat, t in held(model, optimizer, versions):
        reads.plan(t, kind, name, spec, flat, saved.get((kind, name), []))
    # collectives: dcp's plan and read, and under --zero 1, 2 the all-gather of the weights' slices
    with awaiting(f"rank {rank} waited for every rank to load {args.resume_from}", args.timeout_s):
        dcp().load({}, checkpoint_id=args.resume_from, planner=reads)
        reads.finish()
        loaded(optimizer)
    if rank == 0:
        print(f"note: resumed from {args.resume_from} at step {meta['step']}, written by {describe(meta['layout'])}",
              flush=True)
    return meta["step"], meta["layout"]


class SliceReads:
    """DCP's load planner for a resume: of each saved piece, only the box that overlaps a tensor this rank
    holds is read, into that tensor. A tensor held (a flat range first..first+count-1 of a local tensor of
    some shape: a whole tensor, a tp slice, a --zero slice) and a saved piece (an N-d tensor, or a flat
    range of one: `#first:count:shape`) are each cut into boxes, each contiguous in row-major order
    (boxes), and placed in the full tensor (the slice's start along its dim); every pair's overlap is one
    read. DCP narrows an N-d saved piece to the box, so that read goes into a view of the held tensor; a
    flat piece only to a range of it, so a box that is not one range of the piece (across another tp
    split) is read as the range that covers it and copied from there (finish). DCP's reader holds one
    saved piece at a time while it narrows: a flat piece is one replica's share, a whole piece one tensor."""

    def __init__(self, path):
        self.path, self.items, self.dests, self.copies = path, [], {}, []

    def plan(self, t, kind, name, spec, flat, pieces):
        first, count, shape = flat if flat else (0, t.numel(), tuple(t.shape))
        assert t.is_contiguous(), f"{kind}/{name}"
        dest, covered = t.detach().view(-1), 0
        for key, their_spec, their_flat, their_shape, offsets in pieces:
            theirs = their_flat if their_flat else (0, prod(their_shape), their_shape)
            for mine_lo, mine_hi in boxes(shape, first, first + count, spec):
                for lo, hi in boxes(theirs[2], theirs[0], theirs[0] + theirs[1], their_spec):
                    lo, hi = [max(a, b) for a, b in zip(lo, mine_lo)], [min(a, b) for a, b in zip(hi, mine_hi)]
                    if any(a >= b for a, b in zip(lo, hi)):
                        continue
                    sizes = [b - a for a, b in zip(lo, hi)]
                    covered += prod(sizes)
                    into = box_view(dest, shape, local(lo, spec), sizes, first)
                    self.read(key, offsets, their_flat, theirs[2], local(lo, their_spec), sizes, into)
        if covered != count:
            fail(f"the checkpoint {self.path} has {covered} of the {count} elements of {kind}/{name} that this rank "
                 f"needs; it is damaged or of another model", seen_by="this rank")

    def read(self, key, offsets, flat, shape, lo, sizes, into):
        """One read of saved piece `key` into `into`: the box at lo (the piece's local coordinates) of these sizes."""
        if flat is None:                              # an N-d piece: DCP narrows it to the box
            return self.item(key, offsets, lo, sizes, into)
        strides = contiguous_strides(shape)           # a flat piece: the range from the box's first element
        start = sum(i * s for i, s in zip(lo, strides)) - flat[0]
        length = sum((n - 1) * s for n, s in zip(sizes, strides)) + 1
        if length == prod(sizes) and into.is_contiguous():
            return self.item(key, offsets, [start], [length], into.view(-1))
        covering = torch.empty(length, dtype=into.dtype)   # to its last, the box's elements strided in it
        self.item(key, offsets, [start], [length], covering)
        self.copies.append((covering.as_strided(sizes, strides), into))

    def item(self, key, offsets, lo, sizes, into):
        from_dcp = dcp().planner
        fqn = str(len(self.dests))
        self.dests[fqn] = into
        self.items.append(from_dcp.ReadItem(
            type=from_dcp.LoadItemType.TENSOR, dest_index=dcp().metadata.MetadataIndex(fqn),
            dest_offsets=torch.Size([0] * len(sizes)), storage_index=dcp().metadata.MetadataIndex(key, offsets),
            storage_offsets=torch.Size(lo), lengths=torch.Size(sizes)))

    def finish(self):
        """The boxes read as the ranges that cover them, into place."""
        with torch.no_grad():
            for covering, into in self.copies:
                into.copy_(covering)
        self.copies = []

    # DCP's LoadPlanner: every rank reads what it planned, into the tensors it named
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        pass

    def create_local_plan(self):
        return dcp().planner.LoadPlan(self.items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise AssertionError("a resume reads tensors only")

    def resolve_tensor(self, read_item):
        return self.dests[read_item.dest_index.fqn]

    def commit_tensor(self, read_item, tensor):
        pass


def boxes(shape, first, end, spec=None):
    """The elements first..end-1 of a tensor of this shape, flattened, as boxes [(lo, hi)] (hi exclusive), each
    contiguous in row-major order; in the full tensor's coordinates where spec (dim, start, length) places it."""
    for lo, hi in row_major_boxes(tuple(shape), first, end):
        if spec is not None:
            lo, hi = list(lo), list(hi)
            lo[spec[0]] += spec[1]
            hi[spec[0]] += spec[1]
        yield tuple(lo), tuple(hi)


def row_major_boxes(shape, first, end):
    if first >= end:
        return
    if not shape:                                     # a 0-dim tensor: its one element
        yield (), ()
        return
    inner = prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(first, inner), divmod(end, inner)
    if r0 == r1:                                      # within one row
        for lo, hi in row_major_boxes(shape[1:], c0, c1):
            yield (r0,) + lo, (r0 + 1,) + hi
        return
    if c0:                                            # the rest of the first row
        for lo, hi in row_major_boxes(shape[1:], c0, inner):
            yield (r0,) + lo, (r0 + 1,) + hi
        r0 += 1
    if r1 > r0:                                       # whole rows
        yield (r0,) + (0,) * (len(shape) - 1), (r1,) + tuple(shape[1:])
    if c1:                                            # the start of the last row
        for lo, hi in row_major_boxes(shape[1:], 0, c1):
            yield (r1,) + lo, (r1 + 1,) + hi


def local(lo, spec):
    """A corner in the full tensor's coordinates -> in those of the slice that spec names."""
    return [i - spec[1] if spec is not None and d == spec[0] else i for d, i in enumerate(lo)]


def box_view(dest, shape, lo, sizes, first):
    """The box at lo (these sizes) of a tensor of this shape, as a view of dest, which holds its flat
    elements from first on."""
    strides = contiguous_strides(shape)
    return dest.as_strided(sizes, strides, dest.storage_offset() + sum(i * s for i, s in zip(lo, strides)) - first)


def contiguous_strides(shape):
    return [prod(shape[d + 1:]) for d in range(len(shape))]


def prod(values):
    out = 1
    for v in values:
        out *= v
    return out


def joined(pieces, tensors):
    """[(spec, tensor)] of saved pieces ((spec, key, shape, dtype, flat); tensors: key -> the loaded tensor):
    --zero's flat slices of one tensor put back together (the replicas' shares of a bucket tile it), the
    others as they are. For reading a checkpoint whole (tests/test_optimizer.py's full_tensors); a resume
    reads each rank's slices only (SliceReads)."""
    out, made = [], {}
    for piece_spec, k, _, _, flat in pieces:
        if flat is None:
            out.append((piece_spec, tensors[k]))
            continue
        first, count, shape = flat
        if piece_spec not in made:
            made[piece_spec] = torch.zeros(shape, dtype=tensors[k].dtype, device=tensors[k].device)
            out.append((piece_spec, made[piece_spec]))
        made[piece_spec].view(-1)[first:first + count].copy_(tensors[k])
    return out


def describe(layout):
    return ", ".join(f"{k} {v}" for k, v in (layout or {}).items())


def layout_of(program, env, **axes):
    """The layout that writes a checkpoint, for the note and the metrics log's resume record."""
    return {"program": program, "world_size": env.world_size, **axes}

