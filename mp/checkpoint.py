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

The optimizer's state goes through mp.optim's param_state and load_param_state, one parameter at a
time, in the parameter's shape: whatever kinds the optimizer keeps are saved, under their names.

Replicas (data-parallel, or tp ranks holding a replicated tensor) write the same key; DCP's planner
keeps one writer per key. Under --zero each data-parallel replica writes its own slices only, the
flat ranges of each parameter that its share of a bucket holds (the `#first:count:shape` keys: a
sharded state, never the whole state gathered, ZeroOptimizer.saved_pieces); a resume puts the ranges
of a tensor back together first (joined). On resume each rank computes the slice it holds now, asks
DCP for the saved pieces that overlap it (each rank loads its own request: resharding) and cuts its
slice out of them. Why not DTensor: its Shard placement assumes torch.chunk's split (6 over 4 ranks:
2, 2, 2, 0), ours is tensor_split's (2, 2, 1, 1), and the vit splits by whole heads; keys that carry
the slice express any split, and loading whole overlapping pieces costs at most about twice a rank's
share.

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
from mp.optim import load_param_state, param_state, whole_params

# what makes a run what it is: a checkpoint resumes only into a run with the same values
SETTINGS = ("model", "layers", "hidden", "heads", "patch_size", "activation", "data", "seed", "batch_size",
            "optimizer", "lr", "momentum", "weight_decay", "beta1", "beta2", "adam_eps", "dropout", "clip_grad_norm",
            "delay", "experts", "top_k", "aux_loss", "capacity_factor")
# a checkpoint saved before the flag existed: the value it trained with (SGD, without weight decay)
EARLIER = {"activation": "gelu", "delay": 0, "optimizer": "sgd", "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999,
           "adam_eps": 1e-8, "patch_size": 4, "experts": 0, "top_k": 1, "aux_loss": 0.01, "capacity_factor": None}
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
    2BW's rule (a collective); returns (the step to run next, the layout that wrote it), or (0, None)."""
    if not args.resume_from:
        return 0, None
    meta = read_meta(args.resume_from)
    saved = {}                                           # name -> {kind: [(spec, key, shape, dtype, flat)]}
    for k, md in dcp().FileSystemReader(args.resume_from).read_metadata().state_dict_metadata.items():
        kind, name, spec, flat = parse_key(k)
        saved.setdefault(name, {}).setdefault(kind, []).append((spec, k, tuple(md.size), md.properties.dtype, flat))
    plans = []                                           # (kind, name, spec, the tensor it goes into or goes with)
    for name, current, stale, stepped in weights_of(model, versions):
        spec = shard_of(model, name)
        plans.append(("param", name, spec, current))
        if stale is not None:                            # validate() matched the rule: the file has them
            plans.append(("stale", name, spec, stale))
        # the optimizer's kinds, as saved (validate() matched the optimizer); none before the first step
        plans += [(kind, name, spec, stepped) for kind in saved.get(name, {}) if kind not in WEIGHTS]
    wanted = {}
    for kind, name, spec, p in plans:
        for _, k, shape, dtype, _ in pieces_of(saved, kind, name, spec, args.resume_from):
            wanted[k] = torch.empty(shape, dtype=dtype, device=p.device if shape else "cpu")
    states = {}                                          # the tensor stepped -> {kind: this rank's slice}
    # collectives: dcp's load, and under --zero 3 the gathering of the whole weights, which are loaded and
    # give each replica its slice on the way out
    with awaiting(f"rank {rank} waited for every rank to load {args.resume_from}", args.timeout_s):
        dcp().load(wanted, checkpoint_id=args.resume_from)
        with torch.no_grad(), whole_params(optimizer):
            for kind, name, spec, p in plans:
                mine = assemble(pieces_of(saved, kind, name, spec, args.resume_from), wanted, spec, p)
                if kind in WEIGHTS:
                    p.copy_(mine)
                else:
                    states.setdefault(p, {})[kind] = mine
    for p, state in states.items():
        load_param_state(optimizer, p, state)
    if rank == 0:
        print(f"note: resumed from {args.resume_from} at step {meta['step']}, written by {describe(meta['layout'])}",
              flush=True)
    return meta["step"], meta["layout"]


def pieces_of(saved, kind, name, spec, path):
    """The saved pieces of one tensor that overlap this rank's slice (a 0-dim tensor: its one piece)."""
    return overlapping(saved.get(name, {}).get(kind, []), spec, name, path)


def overlaps(piece_spec, spec):
    """Does a saved piece hold any of my slice? A whole tensor on either side, or slices along
    different dims, always do; slices along one dim when their ranges meet."""
    if spec is None or piece_spec is None or piece_spec[0] != spec[0]:
        return True
    return piece_spec[1] < spec[1] + spec[2] and piece_spec[1] + piece_spec[2] > spec[1]


def overlapping(pieces, spec, name, path):
    """The saved pieces of one tensor that overlap the slice this rank holds."""
    found = [piece for piece in pieces if overlaps(piece[0], spec)]
    if not found:
        fail(f"the checkpoint {path} has no piece of {name} that this rank needs; it is damaged or of another "
             f"model", seen_by="this rank")
    return found


def assemble(pieces, wanted, spec, p):
    """This rank's slice, cut out of the saved pieces (whole tensors, or slices along one dim); a 0-dim
    tensor (AdamW's step) as it is."""
    pieces = joined(pieces, wanted)
    whole = next((t for piece_spec, t in pieces if piece_spec is None), None)
    if whole is not None and whole.dim() == 0:
        return whole
    if whole is None:   # slices along one dim: put them in place in a full-size buffer of that dim
        dim = pieces[0][0][0]
        full_len = max(s[1] + s[2] for s, _ in pieces)
        shape = list(pieces[0][1].shape)
        shape[dim] = full_len
        whole = torch.zeros(shape, dtype=p.dtype, device=p.device)
        for piece_spec, t in pieces:   # the parts no piece covers are outside my slice
            whole.narrow(dim, piece_spec[1], piece_spec[2]).copy_(t)
    return whole.narrow(*spec) if spec else whole


def joined(pieces, tensors):
    """[(spec, tensor)] of saved pieces ((spec, key, shape, dtype, flat) as resume reads them; tensors:
    key -> the loaded tensor): --zero's flat slices of one tensor put back together (the replicas'
    shares of a bucket tile it), the others as they are."""
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

