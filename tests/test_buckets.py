"""Gradient readiness is said, not inferred (mp/buckets.py, issue 42): the code that runs the backward
calls GradBuckets.final once it is done with a parameter. A parameter accumulated a different number
of times from one step to the next (a branch taken by more microbatches, an expert of a mixture) gets
exactly the update a plain all-reduce after the backward gives; a bucket said final too early, or
never, stops with one error naming the parameter, never a silently different mean."""
import contextlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import FAST, launch, run_ranks
from mp.buckets import BucketError, GradBuckets
from mp.pp.zero_bubble import has_grad_hooks, split_weight_grads


def model_of(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))


def backwards(model, rank, step, uses):
    """`uses` backwards of this step (the count changes from step to step), each on its own data."""
    for use in range(uses):
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + use)
        model(torch.randn(4, 6, generator=g)).square().mean().backward()


def _changing_counts_case(rank, world, group):
    bucketed, plain = model_of(), model_of()
    # 64 bytes a bucket: the four tensors fall into several buckets, started at different times
    grads = GradBuckets(list(bucketed.parameters()), None, ("the test's all-reduce", 30), bucket_mb=64 / 2**20)
    grads.name_params(bucketed.named_parameters())
    assert len(grads.buckets) > 1
    for step, uses in enumerate([1, 3, 2]):                      # the accumulation count changes
        grads.zero_grad()
        for p in plain.parameters():
            p.grad = None
        backwards(bucketed, rank, step, uses)
        grads.final(list(bucketed.parameters()))                 # said once the last backward is done
        grads.wait()
        backwards(plain, rank, step, uses)
        for p in plain.parameters():                             # the reference: all-reduce after the backward
            dist.all_reduce(p.grad)
            p.grad /= world
        for (name, a), b in zip(bucketed.named_parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), (step, name, (a.grad - b.grad).abs().max())
            with torch.no_grad():                                # the same update on both
                a -= 0.1 * a.grad
                b -= 0.1 * b.grad


def test_a_changing_accumulation_count_gives_the_plain_all_reduce(tmp_path):
    run_ranks(_changing_counts_case, 2, tmp_path)


def _said_too_early_case(rank, world, group):
    model = model_of()
    grads = GradBuckets(list(model.parameters()), None, ("the test's all-reduce", 30))
    grads.name_params(model.named_parameters())
    grads.zero_grad()
    backwards(model, rank, 0, 1)
    grads.final(list(model.parameters()))                        # said final, then another backward
    backwards(model, rank, 0, 1)
    with pytest.raises(BucketError, match=r"a gradient of 2\.(weight|bias) arrived after its bucket's all-reduce"):
        grads.wait()
    grads.zero_grad()                                            # a new step: and a bucket never said final
    backwards(model, rank, 1, 1)
    grads.final([p for name, p in model.named_parameters() if name != "0.weight"])
    with pytest.raises(BucketError, match=r"the gradient of 0\.weight was never said final"):
        grads.wait()


def test_a_gradient_said_final_too_early_or_never_is_an_error(tmp_path):
    run_ranks(_said_too_early_case, 2, tmp_path)


def _zb_in_place_case(rank, world, group):
    """zb under data parallelism: the buckets hook every parameter but the weights W writes itself, so
    W keeps its in-place path (no autograd, mp.pp.zero_bubble.has_grad_hooks is False for them) and
    reports its writes; the averaged gradients are those of the plain backward, all-reduced."""
    split, plain = model_of(), model_of()
    stash = split_weight_grads(split)
    grads = GradBuckets(list(split.parameters()), None, ("the test's all-reduce", 30), direct=stash.weights)
    assert len(stash.weights) == 2 and not any(has_grad_hooks(w) for w in stash.weights)
    assert all(has_grad_hooks(p) for p in split.parameters() if all(p is not w for w in stash.weights))
    grads.zero_grad()
    for mb in range(3):                                          # B of each microbatch, then their Ws
        g = torch.Generator().manual_seed(10 * rank + mb)
        x = torch.randn(4, 6, generator=g)
        with stash.backward_of(mb):
            split(x).square().mean().backward()
        plain(x).square().mean().backward()
    grads.final([p for p in split.parameters() if all(p is not w for w in stash.weights)])   # after the last B
    for mb in range(3):
        stash.weight_grads(mb, grads)                            # in place, into the buckets' views
    grads.final(stash.weights)                                   # after the last W
    grads.wait()
    for p in plain.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    for (name, a), b in zip(split.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_zb_keeps_its_in_place_weight_gradients_under_data_parallelism(tmp_path):
    run_ranks(_zb_in_place_case, 2, tmp_path)


def _uncollected_case(rank, world, group):
    """zero-bubble's W writes its weights' gradients itself, in place: told (arriving, arrived), the buckets
    collect them; untold, the bucket never holds them, and wait() says so, naming the weight and the step (issue
    82: parallel_5d.py's W told only the dense buckets, so the experts stepped on zeros without a word)."""
    for shard, free in ((False, False), (True, False), (True, True)):   # --zero 0, 1, 2
        model = model_of()
        stash = split_weight_grads(model)
        grads = GradBuckets(list(model.parameters()), None, ("the test's all-reduce", 30), shard=shard, free=free,
                            bucket_mb=64 / 2**20, direct=stash.weights)
        grads.name_params(model.named_parameters())
        for step, told in ((3, True), (4, False)):
            grads.zero_grad(step)
            grads.expect(list(model.parameters()))
            with stash.backward_of(0):
                model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
            stash.weight_grads(0, grads if told else None)
            grads.final(list(model.parameters()))
            if told:
                grads.wait()
                continue
            with pytest.raises(BucketError, match=r"^[02]\.weight holds a gradient of step 4 that its bucket never "
                                                  r"collected"):
                grads.wait()


def test_a_gradient_no_bucket_collected_is_an_error(tmp_path):
    run_ranks(_uncollected_case, 2, tmp_path)


def _in_flight_case(rank, world, group):
    """How many reduce-scatters are on their way at once, per backend and --zero, on four one-tensor buckets
    (--zero 2's cut at most 64 bytes; --zero 1's closed once they hold a byte)."""
    import mp.buckets as buckets
    import mp.dp_collectives as collectives
    real, backend, got = buckets.reduce_scatter, collectives.reduce_scatter_copies, {}
    on_way, most = set(), [0]

    class Counted:
        def __init__(self, work):
            self.work = work

        def wait(self):
            on_way.discard(self)
            return self.work.wait()

    def on_its_way(work):
        work = Counted(work)
        on_way.add(work)
        most[0] = max(most[0], len(on_way))
        return work
    buckets.reduce_scatter = lambda *args, **kwargs: on_its_way(real(*args, **kwargs))
    try:
        for copies in (True, False):         # gloo (its reduce-scatter copies: ours all-reduces in place), nccl's faked
            collectives.reduce_scatter_copies = lambda group, copies=copies: copies
            for free in (False, True):       # --zero 1, --zero 2
                model, most[0] = model_of(), 0
                grads = GradBuckets(list(model.parameters()), None, ("the test's reduce-scatter", 30), shard=True,
                                    free=free, bucket_mb=(64 if free else 1) / 2**20)
                assert len(grads.buckets) == 4
                grads.zero_grad()
                backwards(model, rank, 0, 1)
                grads.final(list(model.parameters()))
                grads.wait()
                got[copies, free] = most[0], [g.clone() for g in grads.shard_grads]
    finally:
        buckets.reduce_scatter, collectives.reduce_scatter_copies = real, backend
    # issue 66: no collective copies its bucket now, so on either backend --zero 1 keeps all four on their
    # way; --zero 2 waits for the oldest (waiting frees the bucket): past IN_FLIGHT, and here sooner, since
    # the last bucket (the first layer's weight, 120 bytes) is larger than the set size of 64: before its
    # layer's backward, the ones on their way that would not fit beside it are waited for (room_ahead),
    # so two at most are on their way
    assert {k: v[0] for k, v in got.items()} == {(True, False): 4, (True, True): 2, (False, False): 4,
                                                 (False, True): 2}, got
    # the same bits whichever waits first, and gloo's in-place all-reduce as its own reduce-scatter
    for free in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(got[True, free][1], got[False, free][1]))


def test_zero1_keeps_every_bucket_on_its_way_and_zero2_two(tmp_path):
    """Issue 65, item 3, and 66: the bound of IN_FLIGHT reduce-scatters on their way is for --zero 2 and
    3, where waiting is what frees a bucket; --zero 1 starts every bucket and waits once, on nccl (its
    reduce-scatter is in place) and on gloo (whose reduce-scatter clones the bucket: ours all-reduces the
    bucket itself instead, bit-identical to gloo's own)."""
    run_ranks(_in_flight_case, 2, tmp_path)


# ----------------------------------------------------------------------------- overlap, on the timeline

# one chunk a rank (--dp 2 on 2 ranks: the data axis alone); the mlp's 14 layers of 300 fill two 4 MB
# buckets, the first (the last layers) full after 11 of the 14 layers' backward, the second at its end
OVERLAP = FAST + ["--model", "mlp", "--layers", "14", "--hidden", "300", "--batch-size", "16", "--steps", "2",
                  "--dp", "2", "--microbatches", "2", "--schedule", "1f1b"]


@pytest.mark.parametrize("zero", ["0", "2"])
def test_a_bucket_starts_inside_the_backward_that_finishes_it(zero, tmp_path):
    """Issue 58, item 2: readiness per bucket, not per chunk. On the default 1f1b with one chunk a rank,
    a bucket's collective starts while the chunk's last B still runs (the earlier layers' backward still
    to come), not after it; --zero 2 reduce-scatters in every microbatch's backward: a collective starts
    inside each B, two buckets a microbatch."""
    trace = tmp_path / "trace.json"
    run = launch("pipeline_dp_joint.py", OVERLAP + ["--zero", zero, "--timeline", str(trace)], tmp_path, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["pid"] == 0]
    backwards = [e for e in events if e["cat"] == "backward"]
    collectives = [e for e in events if e["cat"] == "collective"]
    assert [b["name"] for b in backwards] == ["B0", "B1"], events
    for b in backwards if zero == "2" else backwards[-1:]:
        assert any(b["ts"] <= c["ts"] < b["ts"] + b["dur"] for c in collectives), (b, collectives)
    if zero == "2":
        assert sorted(c["name"] for c in collectives) == ["reduce-scatter 0"] * 2 + ["reduce-scatter 1"] * 2


class FakeEvent:
    """torch.cuda.Event on the CPU: record() stamps the next time of a fake GPU clock (ms), which
    advances 5 ms at each record; elapsed_time is the difference of the stamps."""
    clock = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        FakeEvent.clock += 5.0
        self.at = FakeEvent.clock

    def synchronize(self):
        assert self.at is not None, "an event waited for before it was recorded"

    def elapsed_time(self, other):
        return other.at - self.at


class FakeWork:
    """An nccl Work as the host sees it: its future completes when the collective is enqueued."""
    def __init__(self):
        self.waited_on = []

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)           # at enqueue: what nccl's futures do
        return future

    def wait(self):
        self.waited_on.append(torch.cuda.current_stream())


def test_on_a_gpu_the_timeline_clocks_a_collective_with_cuda_events(monkeypatch):
    """Issue 57: on nccl a Work's future completes when the collective is enqueued, so its callback
    would draw a span of nothing. On a GPU the span comes from CUDA events: one recorded on the current
    stream as the collective is enqueued, one on a side stream made to wait for the Work; the span ends
    where that event says, read when the step waits for the collective (faked here on the CPU: each
    record moves the fake GPU clock 5 ms)."""
    from mp.dp_collectives import CollectiveSpans
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: "side stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the current stream")
    recorder = type("Recorder", (), {"events": []})()
    spans, work = CollectiveSpans(recorder), FakeWork()
    spans.begin(work, "reduce-scatter 0", torch.device("cuda", 0))
    assert recorder.events == [] and work.waited_on, "no span before the collective is waited for"
    spans.end(work)
    (cat, name, _, _, start, end), = recorder.events
    assert (cat, name) == ("collective", "reduce-scatter 0")
    # reference at 5 ms, start at 10, end at 15: the span is 5 ms from the events, not 0 from the future
    assert end - start == pytest.approx(5e-3), (start, end)
    spans.begin(FakeWork(), "all-reduce 1", torch.device("cpu"))   # the CPU: the future's callback ends it
    assert [e[1] for e in recorder.events] == ["reduce-scatter 0", "all-reduce 1"]


def test_a_kept_bucket_takes_a_layers_bias_with_its_weight():
    """Issue 66: --zero 0 and 1's buckets close once they hold the set size (DDP's rule). Cut at most that size
    (--zero 2's, where a layer above it is a bucket alone), the mlp's 1024-wide layers (4 MB weights) made
    every 4 KB bias a bucket of its own: 14 collectives a step where 7 do."""
    from mp.buckets import kept_groups
    from mp.dist import buckets as at_most
    model = nn.Sequential(nn.Linear(3072, 1024), *[nn.Linear(1024, 1024) for _ in range(6)], nn.Linear(1024, 10))
    backward_order = list(model.parameters())[::-1]
    kept, cut = kept_groups(backward_order, 4 * 2**20), at_most(backward_order, 4 * 2**20)
    assert (len(kept), len(cut)) == (7, 14)
    assert [len(g) for g in kept] == [4, 2, 2, 2, 2, 2, 2]          # [b8 W8 b7 W7] then a layer each
    assert [p for g in kept for p in g] == backward_order
    assert kept_groups([], 4) == []


def test_kept_buckets_are_half_a_stage_a_layer_whole():
    """--zero 0 and 1's buckets hold half the stage's gradients (mp.buckets.kept_bytes: at least 4 MB, at most
    DDP's 25), a layer's bias with its weight, a larger layer alone, a small last group joined to the one
    before: each collective costs gloo's threads its own start and wait on the cores the backward uses."""
    from mp.buckets import kept_bytes, kept_groups
    mb = lambda groups: [round(sum(p.numel() * 4 for p in g) / 2**20) for g in groups]   # noqa: E731
    # an interleaved stage (tests/test_hot_path.py's stage 0): a 4 MB layer finishes first, then a 12 MB one
    stage = list(nn.Linear(3072, 1024).parameters()) + list(nn.Linear(1024, 1024).parameters())
    order = stage[::-1]
    assert kept_bytes(order) == pytest.approx(8 * 2**20, rel=1e-3)
    groups = kept_groups(order, kept_bytes(order))
    assert mb(groups) == [4, 12] and [len(g) for g in groups] == [2, 2]         # [b W] [b W]
    small = list(nn.Linear(512, 512).parameters())[::-1]                        # 1 MB: the 4 MB floor, one bucket
    assert kept_bytes(small) == 4 * 2**20 and len(kept_groups(small, kept_bytes(small))) == 1
    big = [p for _ in range(25) for p in nn.Linear(1024, 1024).parameters()][::-1]   # 100 MB: DDP's 25 MB cap
    assert kept_bytes(big) == 25 * 2**20 and mb(kept_groups(big, kept_bytes(big))) == [24, 24, 24, 28]   # 4 joined
    tail = [p for n in (64, 1024, 1024) for p in nn.Linear(n, 1024).parameters()][::-1]   # 0.25 MB last: joined
    assert mb(kept_groups(tail, 4 * 2**20)) == [4, 4]


def _apart_case(rank, world, group):
    """--zero 3's blocks on gloo, each gradient larger than the set size: all-reduced where autograd made it
    (Bucket.apart), my slices summed over two microbatches into the accumulators: the plain all-reduce's."""
    model, plain = model_of(), model_of()
    blocks = [list(model[0].parameters()), list(model[2].parameters())]
    grads = GradBuckets(list(model.parameters()), None, ("the test's all-reduce", 30), shard=True, free=True,
                        bucket_mb=16 / 2**20, groups=blocks)
    went_apart, fill = [], grads.fill
    grads.fill = lambda b: (fill(b), went_apart.append(b.apart is not None and b.grad is None))
    grads.zero_grad()
    backwards(model, rank, 0, 2)
    grads.final(list(model.parameters()))
    grads.wait()
    backwards(plain, rank, 0, 2)
    assert went_apart and all(went_apart), went_apart
    for b, mine in zip(grads.buckets, grads.shard_grads):
        by_id = {id(p): q for p, q in zip(model.parameters(), plain.parameters())}
        flat = torch.cat([by_id[id(p)].grad.reshape(-1) for p in b.params])
        dist.all_reduce(flat)
        flat = torch.cat([flat / world, flat.new_zeros(b.padded - b.numel)])
        torch.testing.assert_close(mine, b.shard(flat, rank))    # (the microbatches summed in another order)


def test_a_block_whose_gradients_go_apart_on_gloo_gives_the_plain_all_reduce(tmp_path):
    run_ranks(_apart_case, 2, tmp_path)


# ----------------------------------------------------------------------------- the heap between steps (mp.heap)


def mapped_blocks():
    """How many blocks glibc holds as mappings of their own (mallinfo2().hblks), or None without glibc's."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    mallinfo2.restype = MallInfo2
    return mallinfo2().hblks


def heap_probe(buckets):
    """A lazy --zero 0 model's bucket bytes, twice (what keep_in_heap lifts the threshold past), and whether a
    block of that size then comes as a mapping of its own (given back whole when freed), with or without
    GradBuckets made first. Its own fresh process each way: a mapped block freed lifts the threshold too."""
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))   # 2 MB of weights: lazy --zero 0 buckets
    if buckets:
        grads = GradBuckets(list(model.parameters()), None, ("the test's all-reduce", 30), bucket_mb=1)
        assert all(b.lazy for b in grads.buckets)
    before = mapped_blocks()
    block = torch.empty(2 * sum(p.numel() * p.element_size() for p in model.parameters()), dtype=torch.uint8)
    return mapped_blocks() > before


def _heap_plain_case(rank, world, group):
    assert heap_probe(buckets=False), "glibc's threshold was already that high: the test could not fail"


def _heap_case(rank, world, group):
    assert not heap_probe(buckets=True)   # from the heap: kept there when a step lets it go


def test_the_buckets_memory_stays_in_the_heap_between_steps(tmp_path):
    """mp.heap: the bytes the lazy buckets let go at every zero_grad are kept by glibc, not given back to the
    kernel and faulted in again in the next step (a vit rank of D = 4 alone: 2,900 page faults a step before).
    Without the buckets, in the same fresh process, a block of that size is a mapping of its own."""
    if mapped_blocks() is None:
        pytest.skip("glibc's mallinfo2 (glibc 2.33 and later) counts the mapped blocks; this C library has none")
    for case in (_heap_plain_case, _heap_case):
        (tmp_path / case.__name__).mkdir()
        run_ranks(case, 1, tmp_path / case.__name__)
