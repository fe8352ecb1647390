"""One mesh for every program: the world laid out once on named axes, and every process group built from it.

The ranks are numbered in one tensor that anyone can print, ranks = arange(world).view(dp, pp, cp, tp):
dp outermost, then pp, then cp, tp innermost. Every group is a line of that tensor (or of a plane, for
dp x cp), so "who talks to whom" is read off one picture. For 16 ranks, dp 2 pp 2 cp 2 tp 2:

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

                    stage 0 (pp 0)               stage 1 (pp 1)
                   cp 0       cp 1              cp 0       cp 1
    replica 0:   [ 0 | 1 ]  [ 2 | 3 ]  ---->  [ 4 | 5 ]  [ 6 | 7 ]        node 0 (8 ranks a node)
    replica 1:   [ 8 | 9 ]  [10 |11 ]  ---->  [12 |13 ]  [14 |15 ]        node 1

    tp  [ | ]   neighbours, 1 apart: {0,1}         collectives inside every layer        (most often)
    cp          2 apart: {0,2}                     the ring / all-to-all of every attention layer
    pp  ---->   4 apart: {0,4}                     point-to-point, every microbatch, one neighbour
    dp          8 apart: {0,8}                     the gradient sync, once or M times a step
    dp x cp     {0,2,8,10}: a stage's ranks that hold the same weights (dense gradients, ZeRO, the loss)
    ep          folded over a stage's dp x cp x tp ranks (Megatron's "MoE parallel folding"): ep 4 =
                {0,1,2,3} {8,9,10,11}; ep 2 = {0,1} {2,3} ...: consecutive in the (dp, cp, tp) order, so an
                expert group takes the closest ranks (tp first) and stays on a node; each token is routed once
    edp         the stage's ranks holding the same experts: ep 2 gives {0,2,8,10} {1,3,9,11}; ep 4 {0,8} ...

Why this order: the more often an axis talks, the closer its ranks are numbered, and torchrun gives
consecutive ranks to one node, so tp (every layer) lands on the fastest links, then cp. dp outermost,
pp inside it, keeps a whole pipeline on one node and sends only the gradient sync across nodes. Megatron
puts pp outermost instead (a pipeline's small messages cross nodes and its dp groups stay inside them);
this order is the one pipeline_dp_joint.py (view(dp, pp)) and parallel_3d.py (view(dp, pp, tp)) always
had, so every rank keeps its coordinates and every sum its order: their numbers stay bit-identical.

Each rank makes only its own group of each name, one name at a time in the order of GROUPS (Mesh.build).
Axes of size 1 get real groups of one rank too: a collective on a group of one is a no-op, while None
would mean WORLD, and code that runs on WORLD "because it is alone" is what composition breaks. Until
2026-12-07 every rank called new_group for every line of every name, a world-wide call: 36 at 8 ranks
(dp 2 pp 2 tp 2 ep 2), 56 at 16 (dp 2 pp 2 cp 2 tp 2 ep 4), 152 at 64 (dp 4 pp 2 cp 2 tp 4 ep 4),
1,600 at 1,024 (dp 8 pp 8 cp 2 tp 8 ep 8). Now, on gloo, a group is made by its members alone (new_group's
use_local_synchronization): 7 calls a rank, none world-wide. It cannot deadlock, and its members agree
on the name torch gives it (from its ranks and how many groups each rank made before): every rank is in
exactly one line of each name, so a group's members all make it as their k-th. On nccl with a bound
device (mp.dist binds one) torch makes every new_group an ncclCommSplit of the world, which every rank
must join (non-members with no colour): made by its members alone, a group would leave them waiting in
the split for the rest. There each name is one dist.split_group of the world, as torch's DeviceMesh
does: one ncclCommSplit, each rank coloured by its line, 7 world-wide calls a rank at any size, where
there were 56 at 16 ranks and 1,600 at 1,024 (not yet timed on a GPU). Measured on gloo (2 shared CPU
cores, ranks forked by mp.tools.torchrun, 2026-12-07; Mesh.build's slowest rank, the median of 3-5
launches): 8 ranks 66 ms before, 60 ms now; 16 ranks 179 ms, 134 ms; 64 ranks 1.35 s, 1.19 s (64 ranks
on 2 cores: +-0.3 s); still one gloo loop thread a rank. Little, as a gloo group's non-members only
kept books; what shrinks is the calls: as rank r of a world of fakes (torch's fake backend and FakeStore,
one process) Mesh.build took 1.4, 1.7, 6.3 and 72 ms at 8, 16, 64 and 1,024 ranks; now 0.8, 1.0, 1.0, 2.4 ms.
On gloo, torch gives every group a transport of its own (a "device": a listening socket and an event-loop
thread that wakes every 10 ms, idle or not), so pipeline_dp_joint.py --dp 4 (8 groups a rank: the world's
and one for each of GROUPS) woke 800 times a second a rank where DDP (1 group) wakes 100. Our groups share
the world group's device instead (new_group): each is still a group of its own, with its own connections,
order of collectives and two worker threads; only the socket and the loop thread are shared, as all of
DDP's traffic shares them. Measured on the vit's --zero 0 pair (benchmarks/data_axis.py, 4 ranks on 2
cores, 2026-11-28): 25 threads a rank became 18; over 30 steps the 4 ranks' loop threads switched 75-82
thousand times, now 22 (DDP's 16); over 10 paired rounds each, the cores' idle share 5.1% became 3.5%
(DDP's 2.8-3.2%), while the step time's ratio to DDP's stayed where it was, within the noise (1.048, 1.047);
our mlp 8 x 1024 alone, shared against torch's own groups (8 runs each, in turn): --zero 0 0.98, --zero 2 0.94.
Groups with the same members (dp and dp x cp when cp is 1) stay two groups (two calls, two splits), so
that collectives on two axes never queue behind each other in one group's order; each group's ranks are
its line's, in its order (a line's ranks ascend, so neither new_group's sort nor a split reorders them).
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mp.traffic import METER

AXES = ("dp", "pp", "cp", "tp")                          # the numbering, outermost first
GROUPS = ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")  # the order every rank creates them in


def layout(world, dp=1, cp=1, tp=1):
    """ranks = arange(world).view(dp, pp, cp, tp), pp what the world leaves; ValueError if it does not tile."""
    if min(dp, cp, tp) < 1 or world % (dp * cp * tp):
        raise ValueError(f"the world size {world} is not divisible by dp {dp} x cp {cp} x tp {tp} = {dp * cp * tp}")
    return torch.arange(world).view(dp, world // (dp * cp * tp), cp, tp)


def lines(ranks, ep=1):
    """{group name: the member lists of every group of that name}, for every rank, from the layout alone
    (no process group: tests read it). A line of an axis holds the ranks that differ only in that coordinate."""
    dp, pp, cp, tp = ranks.shape
    if ep < 1 or (dp * cp * tp) % ep:
        raise ValueError(f"ep {ep} does not divide dp {dp} x cp {cp} x tp {tp} = {dp * cp * tp}: the experts are "
                         f"folded over a stage's dp x cp x tp ranks, so use an ep that divides {dp * cp * tp}")
    found = {name: along(ranks, AXES.index(name)) for name in ("pp", "dp", "cp", "tp")}
    # a stage's ranks of one tp rank, in (dp, cp) order: [pp, tp, dp x cp]
    stage = ranks.permute(1, 3, 0, 2).reshape(pp, tp, dp * cp)
    found["dp_cp"] = stage.reshape(-1, dp * cp).tolist()
    # a stage's ranks in (dp, cp, tp) order, cut into expert groups of ep consecutive ranks: the closest
    plane = ranks.permute(1, 0, 2, 3).reshape(pp, dp * cp * tp // ep, ep)
    found["ep"] = plane.reshape(-1, ep).tolist()
    found["edp"] = plane.transpose(1, 2).reshape(-1, dp * cp * tp // ep).tolist()   # the same ep rank: same experts
    return {name: found[name] for name in GROUPS}


def embedding_lines(pp_lines, stages):
    """Megatron's embedding group: in each pipeline, the ranks of the stages that hold the tied embedding (its
    first stage and its last; one rank where they coincide, zbv's V), their weight's gradients summed over it.
    Every other rank gets a group of its own, so that the lines cover every rank once (as a split asks)."""
    stages = sorted(set(stages))
    found = []
    for line in pp_lines:
        found.append([line[s] for s in stages])
        found += [[r] for s, r in enumerate(line) if s not in stages]
    return found


def along(ranks, axis):
    """The lines of the tensor along one axis, in row-major order of the other coordinates."""
    return ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()


def world_splits():
    """Does torch make a new group by splitting the world's communicator? On nccl with a bound device (mp.dist
    binds one) it does: new_group is then an ncclCommSplit of the world, which every rank must join."""
    world = dist.group.WORLD
    return world is not None and dist.get_backend() == "nccl" and getattr(world, "bound_device_id", None) is not None


def split_axis(rank, axis_lines, timeout, desc):
    """My group along one axis, all of the axis's groups made by one split of the world (as torch's DeviceMesh
    does): one ncclCommSplit, each rank coloured by its line, where a new_group a line would be one each. The
    lines of an axis cover every rank once, which a split asks; each keeps its order (its ranks ascend)."""
    return dist.split_group(split_ranks=axis_lines, timeout=timeout, group_desc=desc)


def my_line(rank, axis_lines, timeout, desc):
    """My group along one axis, made by its members alone: the other ranks do not take part (my line is one
    of theirs only if they are in it). Deadlock-free because every rank is in exactly one line of each axis
    and makes its lines in the order of GROUPS: a group's members all make it as their k-th group, so they
    meet, and they agree on the name torch gives it (its ranks and how many groups each made before)."""
    mine = next(line for line in axis_lines if rank in line)
    return new_group(mine, timeout, desc)


SHARED_GLOO = "gloo_world_device"   # what dist.get_backend(group) says for a gloo group made by new_group


def new_group(line, timeout, desc=None):
    """dist.new_group(line) on its members alone (use_local_synchronization: the ranks outside it do not
    call), on gloo one that shares the world group's device (the module's docstring says why). torch names
    no public option for the device: where this torch lacks the private ones used here, a plain group (the
    same numbers, a loop thread of its own). Every rank runs the same torch, so all choose alike."""
    options = dict(timeout=timeout, use_local_synchronization=True, group_desc=desc)
    if dist.get_backend() != "gloo" or world_devices() is None or not hasattr(dist.ProcessGroupGloo, "_Options"):
        return dist.new_group(line, **options)
    if SHARED_GLOO not in dist.Backend.backend_list:   # once a process: new_group's backend= then knows it
        dist.Backend.register_backend(SHARED_GLOO, gloo_on_world_device, extended_api=True, devices=["cpu"])
    return dist.new_group(line, backend=SHARED_GLOO, **options)


def gloo_on_world_device(opts, backend_options=None):
    """register_backend's maker of a group (torch calls it inside new_group, on the group's members only):
    torch's own ProcessGroupGloo, with its timeout and worker threads, on the world group's device (one a
    network interface where GLOO_SOCKET_IFNAME names several)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = world_devices()
    options._timeout = opts.timeout
    options._threads = 2 * len(options._devices)   # as torch makes a gloo group: two worker threads a device
    group = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
    group.options.global_ranks_in_group = opts.global_ranks_in_group
    group.options.group_name = opts.group_id
    return group


def world_devices():
    """The world group's gloo devices, or None where this torch does not show them (private attributes)."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._devices
    except (AttributeError, RuntimeError):
        return None


@dataclass
class Mesh:
    """Who am I on the mesh: my coordinate and my process group along each axis. Groups are handed to
    the code that uses them (mesh.dp_group at the call), never kept in a global."""
    rank: int
    ranks: torch.Tensor        # arange(world).view(dp, pp, cp, tp): print it
    lines: dict                # group name -> every group's members along it (not only mine)
    groups: dict = field(repr=False)   # group name -> my process group along it
    timeout: object = None     # what every group was made with (mp.dist.group_timeout)

    @classmethod
    def build(cls, rank, world, dp=1, cp=1, tp=1, ep=1, timeout=None, tied=None):
        """Lay the world out and make my group along every axis (every rank calls it, with the same sizes):
        one axis at a time, in the order of GROUPS on every rank. timeout: the default group's; new_group's
        own default is 30 minutes, so a rank waiting on a stopped peer would hang that long. Bad sizes
        raise ValueError before any group is made. tied (the gpt's --tie-embeddings under a pipeline): the
        pp coordinates of the stages that hold the tied embedding (its first and its last), which get one
        more group, "embed", made after the others (embedding_lines)."""
        ranks = layout(world, dp, cp, tp)
        members = lines(ranks, ep)
        names = GROUPS
        if tied is not None:
            members["embed"], names = embedding_lines(members["pp"], tied), GROUPS + ("embed",)
        make = split_axis if world_splits() else my_line
        groups = {name: make(rank, members[name], timeout, f"mesh_{name}") for name in names}
        mesh = cls(rank, ranks, members, groups, timeout)
        METER.name_groups(groups, {name: mesh.peers(name) for name in names})   # the summary's bytes, by axis
        return mesh

    def peers(self, name):
        """The global ranks of my group along `name` (mine among them), in the order of its coordinate."""
        return next(line for line in self.lines[name] if self.rank in line)

    def coordinate(self, name):
        return self.peers(name).index(self.rank)

    def size(self, name):
        return len(self.lines[name][0])

    # my group along each axis, named where a collective runs on it
    pp_group = property(lambda self: self.groups["pp"])         # my pipeline: point-to-point between stages
    dp_group = property(lambda self: self.groups["dp"])         # my stage's replicas at my cp and tp coordinates
    cp_group = property(lambda self: self.groups["cp"])         # the ranks that split my sequences
    tp_group = property(lambda self: self.groups["tp"])         # the ranks that split my stage's layers
    dp_cp_group = property(lambda self: self.groups["dp_cp"])   # every rank holding my dense weights
    ep_group = property(lambda self: self.groups["ep"])         # the ranks my tokens' experts are spread over
    edp_group = property(lambda self: self.groups["edp"])       # the ranks holding my experts
    embed_group = property(lambda self: self.groups["embed"])   # the stages holding the tied embedding (Mesh.build)

    dp_rank = property(lambda self: self.coordinate("dp"))
    pp_rank = property(lambda self: self.coordinate("pp"))
    cp_rank = property(lambda self: self.coordinate("cp"))
    tp_rank = property(lambda self: self.coordinate("tp"))
    ep_rank = property(lambda self: self.coordinate("ep"))
    edp_rank = property(lambda self: self.coordinate("edp"))
    dp_cp_rank = property(lambda self: self.coordinate("dp_cp"))   # dp_rank * cp + cp_rank: my (dp, cp) slice

    dp_size = property(lambda self: self.size("dp"))
    pp_size = property(lambda self: self.size("pp"))
    cp_size = property(lambda self: self.size("cp"))
    tp_size = property(lambda self: self.size("tp"))
    ep_size = property(lambda self: self.size("ep"))
    edp_size = property(lambda self: self.size("edp"))
    dp_cp_size = property(lambda self: self.size("dp_cp"))
