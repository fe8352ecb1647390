"""The data-parallel collectives that mp.buckets (the gradients), mp.zero and mp.param_shards (the weights)
start, each on a flat tensor in place, and their spans on the pipeline's timeline.

In place on every backend. nccl's reduce-scatter and all-gather read and write the buffers they are given.
torch's gloo ones do not: its reduce-scatter clones the whole input, all-reduces the clone and copies my
chunk out (a second bucket's worth of memory for each one on its way: 9 buckets of 4 MB at once raised a
process's peak by 40 MB, where all-reduces raised it 5), and its all-gather receives into a temporary the
size of the output, then copies. So on gloo reduce_scatter all-reduces the bucket itself in place and
all_gather broadcasts each replica's slice straight into its place: the same bytes on the wire (gloo's
reduce-scatter is an all-reduce on the wire anyway), the same sums bit for bit, no copy
(tests/test_buckets.py, tests/test_zero.py).

CollectiveSpans draws each collective on the timeline's collective row (--timeline), from when it was
started to its end, on the CPU and on a GPU.
"""
import time

import torch
import torch.distributed as dist

from mp.mesh import SHARED_GLOO

# torch 2.14 renamed reduce_scatter_tensor and all_gather_into_tensor (the old names warn); either works
def REDUCE_SCATTER(*args, **kwargs):   # looked up at the call: mp.traffic counts the one called
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def ALL_GATHER(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_copies(group):
    """Does this group's reduce-scatter work on a copy of its bucket, held until it is done? gloo's does:
    torch's ProcessGroupGloo reduce-scatters by cloning the whole input, all-reducing the clone and copying
    my chunk out of it; nccl's reads and writes the bucket itself."""
    return dist.get_backend(group) in ("gloo", SHARED_GLOO)


def all_gather(flat, mine, rank, group):
    """Start gathering every replica's slice `mine` into `flat` (slice d at d's offset). gloo's all-gather
    receives into a temporary the size of `flat` and then copies it over (torch's ProcessGroupGloo), a second
    bucket's worth at the moment the weights are made whole; there each replica's slice is broadcast from it
    straight into its place instead: D broadcasts, the same bytes received, the same bits, no temporary."""
    if not reduce_scatter_copies(group):
        return ALL_GATHER(flat, mine, group=group, async_op=True)
    parts = flat.split(flat.numel() // dist.get_world_size(group))
    if parts[rank].data_ptr() != mine.data_ptr():
        parts[rank].copy_(mine)
    return Works([dist.broadcast(part, group_src=d, group=group, async_op=True) for d, part in enumerate(parts)])


class Works:
    """Several collectives waited for as one (all_gather's broadcasts)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()
        return True

    def get_future(self):
        raise RuntimeError("several collectives: no one future")   # CollectiveSpans ends the span at the wait


def reduce_scatter(flat, rank, group):
    """Start the sum of `flat` over the group into my 1/D of it, in place. Where the backend's reduce-scatter
    would clone the bucket (gloo: reduce_scatter_copies), the bucket is all-reduced in place instead: the
    same all-reduce gloo runs on its clone, so the same bytes sent and the same sums, bit for bit, without
    the copy (a second bucket's worth of memory for each one on its way). The rest of the bucket then holds
    the other slices' sums, which nobody reads."""
    size = flat.numel() // dist.get_world_size(group)
    if reduce_scatter_copies(group):
        return dist.all_reduce(flat, group=group, async_op=True)
    return REDUCE_SCATTER(flat[rank * size:(rank + 1) * size], flat, group=group, async_op=True)


class CollectiveSpans:
    """The timeline's collective row (when the recorder records): each collective's span, from when it
    was started to its end. On the CPU (gloo) a Work's future completes with the collective, so its
    callback ends the span; gloo's reduce-scatter and all-gather have none (get_future raises): their
    span ends where the step waited for them, at most that long. On a GPU the future of an nccl Work
    completes when the collective is enqueued, not when it ends, so the span is read from CUDA events
    instead: one recorded on the current stream as the collective is enqueued (nccl's stream starts
    after what was queued before it) and one on a side stream made to wait for the Work (the host does
    not wait), both read against a reference event when the step waits for the collective."""

    def __init__(self, recorder):
        self.recorder, self.open, self.side, self.reference = recorder, [], None, None

    def events(self):
        return getattr(self.recorder, "events", None)

    def begin(self, work, name, device):
        events = self.events()
        if events is None:
            return
        if device.type == "cuda":
            self.open.append((work, name, self.cuda_marks(work, device)))
            return
        start = time.perf_counter()
        try:
            future = work.get_future()
        except RuntimeError:
            self.open.append((work, name, start))
            return
        future.add_done_callback(lambda _: events.append(("collective", name, None, 0, start, time.perf_counter())))

    def cuda_marks(self, work, device):
        """(start event, end event) of a collective just enqueued on a GPU; the reference (an event and
        the host's clock when it completed) is taken when no span is open, once per burst of collectives."""
        if not self.open:
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()
            self.reference.synchronize()
            self.reference = (self.reference, time.perf_counter())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.side = self.side or torch.cuda.Stream(device)
        with torch.cuda.stream(self.side):
            work.wait()                   # the side stream waits for the collective; the host goes on
            end.record(self.side)
        return start, end, self.reference

    def end(self, work):
        """work was waited for: its span on the timeline, if no callback ends it."""
        events = self.events()
        for item in [u for u in self.open if u[0] is work]:
            self.open.remove(item)
            if events is None:
                continue
            if isinstance(item[2], tuple):    # a GPU's: from its events, on the host's clock
                start, end, (reference, host) = item[2]
                end.synchronize()
                span = (host + reference.elapsed_time(start) / 1e3, host + reference.elapsed_time(end) / 1e3)
            else:
                span = (item[2], time.perf_counter())
            events.append(("collective", item[1], None, 0, *span))
