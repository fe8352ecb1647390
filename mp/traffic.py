"""Every message a rank sends in a step, counted by the group it goes over: the summary's
<group>_sent_mb_per_step (tp, cp, pp, dp, dp_cp, ep, edp, world: each rank's bytes a step) and
--trace-collectives (rank 0's first step, every collective and point-to-point send in the order it ran,
with its group, shape and bytes), so that each formula of docs/parallel_5d.md has its count beside it.

How: while a step runs (counting()), the functions of torch.distributed that move data are swapped for
ones that count and then call them; the programs call dist.all_reduce(...) as they are written, and the
count sees each call, the lesson's and the package's alike. Outside the steps nothing is swapped (the
evaluation, the checkpoints and the summary's own gathers are not counted). Sizes come from the tensors'
shapes on the host: nothing is read from the device.

What a rank sends, as a ring moves it (mp.buckets counts its buckets the same way), n the group's ranks:

    all_reduce                          2 (n-1)/n x the tensor
    reduce_scatter_tensor (_single)     (n-1)/n x the input
    all_gather, all_gather_into_tensor  (n-1) x my part
    (all_gather_single)
    all_to_all_single                   the rows for the other ranks (without splits: (n-1)/n x the input)
    broadcast                           (n-1) x the tensor from its source, nothing from the others
                                        (gloo's all-gather by n broadcasts, mp/dp_collectives.py, adds up
                                        to an all-gather's)
    batch_isend_irecv                   each isend's tensor (an irecv sends nothing)

Groups are named by the mesh (mp/mesh.py registers each axis's group); a point-to-point message on the
default group is a pipeline's (the stages send to global ranks), "pp"; any other default-group call,
"world"."""
import contextlib

import torch.distributed as dist

# torch 2.14 names reduce_scatter_tensor and all_gather_into_tensor reduce_scatter_single and all_gather_single
COUNTED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather", "all_gather_into_tensor",
           "all_gather_single", "all_to_all_single", "broadcast", "batch_isend_irecv")
REDUCE_SCATTERS, ALL_GATHERS = ("reduce_scatter_tensor", "reduce_scatter_single"), \
    ("all_gather", "all_gather_into_tensor", "all_gather_single")
# where each call's tensor that sets the bytes, and its group, sit: (position, keyword) in torch's signatures
TENSOR = {"all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "all_gather": (1, "tensor"),
          "all_gather_into_tensor": (1, "input_tensor"), "all_gather_single": (1, "input_tensor"),
          "reduce_scatter_tensor": (1, "input"), "reduce_scatter_single": (1, "input"),
          "all_to_all_single": (1, "input")}
GROUP = {"all_reduce": 2, "broadcast": 2, "all_gather": 2, "all_gather_into_tensor": 2, "all_gather_single": 2,
         "reduce_scatter_tensor": 3, "reduce_scatter_single": 3, "all_to_all_single": 4}


class Meter:
    """The counts of one process: bytes per group name over the counted steps, and the trace of one."""

    def __init__(self):
        self.names = {}              # id(process group) -> its axis name
        self.members = {}            # axis name -> my group's global ranks
        self.bytes = {}              # axis name -> bytes sent in the counted steps
        self.trace = None            # a list of lines while a step is traced

    def name_groups(self, groups, peers):
        """The mesh's groups {axis: group}, and my members along each {axis: [ranks]}; a group two axes share
        (the same ranks) keeps the first name."""
        for name, group in groups.items():
            self.names.setdefault(id(group), name)
            self.members.setdefault(name, peers[name])

    def name_of(self, group, p2p=False):
        if group is None or group is dist.group.WORLD:
            return "pp" if p2p else "world"
        return self.names.get(id(group), "other")

    @contextlib.contextmanager
    def counting(self, trace=False):
        """Count (and with trace, list) what the code inside sends; the functions are swapped back after."""
        originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}
        self.trace = [] if trace else None
        for name, fn in originals.items():
            setattr(dist, name, self._counted(name, fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def _counted(self, op, fn):
        def call(*args, **kwargs):
            for group, nbytes, what in sends(op, args, kwargs):
                self.add(op, group, nbytes, what)
            return fn(*args, **kwargs)
        call.__wrapped__ = fn
        return call

    def add(self, op, group, nbytes, what):
        name = self.name_of(group, p2p=op == "batch_isend_irecv")
        self.bytes[name] = self.bytes.get(name, 0) + nbytes
        if self.trace is not None:
            ranks = self.members.get(name)
            where = f"{name} {{{','.join(map(str, ranks))}}}" if ranks else name
            self.trace.append(f"{len(self.trace) + 1:3d}. {op:<22} on {where:<16} {what}, sends {mb(nbytes)}")


def mb(nbytes):
    return f"{nbytes / 2**20:.4f} MB" if nbytes < 2**20 else f"{nbytes / 2**20:.2f} MB"


def nbytes_of(t):
    return t.numel() * t.element_size()


def shape_of(t):
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def argument(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def sends(op, args, kwargs):
    """[(group, bytes this rank sends, what)] of one call (see the module's docstring)."""
    if op == "batch_isend_irecv":
        return [(p.group, nbytes_of(p.tensor), f"isend {shape_of(p.tensor)} to rank {p.peer}")
                for p in args[0] if getattr(p.op, "__name__", "") == "isend"]
    t, group = argument(args, kwargs, *TENSOR[op]), argument(args, kwargs, GROUP[op], "group")
    n, total = dist.get_world_size(group), nbytes_of(t)
    if op == "all_reduce":
        sent = 2 * (n - 1) * total // n
    elif op in REDUCE_SCATTERS:
        sent = (n - 1) * total // n
    elif op in ALL_GATHERS:
        sent = (n - 1) * total
    elif op == "broadcast":
        source = kwargs.get("group_src")
        if source is None:   # src: a global rank
            src = argument(args, kwargs, 1, "src")
            source = src if group is None else dist.get_group_rank(group, src)
        sent = (n - 1) * total if source == dist.get_rank(group) else 0
    else:
        splits = argument(args, kwargs, 3, "input_split_sizes")
        if splits:
            row = total // max(t.shape[0], 1)
            sent = (sum(splits) - splits[dist.get_rank(group)]) * row
        else:
            sent = (n - 1) * total // n
    return [(group, sent, shape_of(t))]


METER = Meter()   # one a process: torch.distributed's functions are one a process too
