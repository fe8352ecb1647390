"""How many world-wide calls making the mesh's groups takes (issue 82, item 9). Counted against stand-ins
of torch's new_group and split_group, every rank of 8, 16 and 64 in turn (no processes): on gloo each rank
makes only its own 7 groups with their members alone (none world-wide, where a new_group a line would be
32, 48, 128 with ep folded over tp; 36, 56, 152 before); on nccl with a bound device one split of the
world an axis (7). Each group of lines() is made once,
by exactly its members, all as the same k-th call: they meet, and torch names it alike on each. With
processes (4 gloo ranks): 7 calls a rank, and each group holds lines()'s members in lines()'s order; (2 ranks)
a peer that never comes ends the wait at the mesh's timeout."""
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from helpers import run_ranks
from mp import mesh as mesh_module
from mp.mesh import GROUPS, Mesh, layout, lines

# (world, sizes, ep, groups of lines(): what a new_group a line on every rank made every rank call)
SCALES = [(8, dict(dp=2, tp=2), 2, 32), (16, dict(dp=2, cp=2, tp=2), 4, 48), (64, dict(dp=4, cp=2, tp=4), 4, 128)]


def recorded_calls(monkeypatch, world, sizes, ep, backend):
    """Mesh.build on every rank with torch's new_group and split_group replaced by recorders, the world
    on `backend` (nccl: a bound device, so groups are splits): ({rank: mesh}, {rank: [(call, ranks)]})."""
    calls, meshes = {}, {}
    mine = lambda rank, line_list: next(line for line in line_list if rank in line)   # noqa: E731
    monkeypatch.setattr(mesh_module, "world_splits", lambda: backend == "nccl")
    monkeypatch.setattr(mesh_module, "world_devices", lambda: None)     # gloo: the plain dist.new_group
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    for rank in range(world):
        calls[rank] = []

        def new_group(ranks, timeout=None, use_local_synchronization=False, **kw):
            calls[rank].append(("member-only" if use_local_synchronization else "world-wide", list(ranks)))
            return ("group", tuple(ranks))

        def split_group(split_ranks, timeout=None, **kw):
            calls[rank].append(("world-wide split", split_ranks))
            return ("group", tuple(mine(rank, split_ranks)))
        monkeypatch.setattr(dist, "new_group", new_group)
        monkeypatch.setattr(dist, "split_group", split_group)
        meshes[rank] = Mesh.build(rank, world, ep=ep, timeout=timedelta(seconds=9), **sizes)
    return meshes, calls


@pytest.mark.parametrize("world,sizes,ep,before", SCALES)
def test_on_gloo_each_rank_makes_only_its_own_groups(monkeypatch, world, sizes, ep, before):
    table = lines(layout(world, **sizes), ep)
    assert sum(map(len, table.values())) == before          # what each rank called before, world-wide
    meshes, calls = recorded_calls(monkeypatch, world, sizes, ep, "gloo")
    makers = {}                                            # (name, members) -> {k: the ranks making it as call k}
    for rank, made in calls.items():
        assert [kind for kind, _ in made] == ["member-only"] * len(GROUPS)    # 7, none world-wide
        for k, (name, (_, ranks)) in enumerate(zip(GROUPS, made)):
            assert ranks == meshes[rank].peers(name) and meshes[rank].groups[name] == ("group", tuple(ranks))
            makers.setdefault((name, tuple(ranks)), {}).setdefault(k, []).append(rank)
    # every group of lines() made, by exactly its members, all as their same k-th call (so they meet)
    assert sorted(makers) == sorted((name, tuple(line)) for name in GROUPS for line in table[name])
    for (name, members), by_call in makers.items():
        assert by_call == {GROUPS.index(name): list(members)}, (name, members)


@pytest.mark.parametrize("world,sizes,ep,before", SCALES)
def test_on_nccl_each_axis_is_one_split_of_the_world(monkeypatch, world, sizes, ep, before):
    table = lines(layout(world, **sizes), ep)
    meshes, calls = recorded_calls(monkeypatch, world, sizes, ep, "nccl")
    splits = [("world-wide split", table[name]) for name in GROUPS]   # the same 7 calls, in order, on every rank
    for rank, made in calls.items():
        assert made == splits and len(made) == 7 < before
        assert all(meshes[rank].groups[name] == ("group", tuple(meshes[rank].peers(name))) for name in GROUPS)


def test_every_line_ascends_so_no_group_is_reordered():
    """new_group sorts a group's ranks (its group ranks follow the sorted order) and a split keeps them:
    the two agree with lines() only because every line already ascends."""
    for world, sizes, ep, _ in SCALES + [(6, dict(dp=2), 1, 0), (16, dict(dp=2, cp=2, tp=2), 2, 0)]:
        for name, line_list in lines(layout(world, **sizes), ep).items():
            assert all(line == sorted(line) for line in line_list), name


def _counted_case(rank, world, group):
    """dp 2 x tp 2 (cp 1: dp and dp x cp the same members; cp, ep groups of one) on real gloo groups:
    7 new_group calls a rank, each on its members alone, and every group is lines()'s, in its order."""
    made, real = [], dist.new_group

    def counting(*args, **kwargs):
        made.append(kwargs.get("use_local_synchronization"))
        return real(*args, **kwargs)
    dist.new_group = counting
    try:
        mesh = Mesh.build(rank, world, dp=2, tp=2, timeout=timedelta(seconds=60))
    finally:
        dist.new_group = real
    assert made == [True] * len(GROUPS), made
    for name in GROUPS:
        assert dist.get_process_group_ranks(mesh.groups[name]) == mesh.peers(name), name
        assert dist.get_rank(mesh.groups[name]) == mesh.coordinate(name), name
    assert mesh.dp_group is not mesh.dp_cp_group and dist.get_world_size(mesh.cp_group) == 1


def test_real_groups_are_the_lines_made_with_seven_calls(tmp_path):
    run_ranks(_counted_case, 4, tmp_path)


def _absent_peer_case(rank, world, group):
    """Rank 1 never makes its groups: rank 0, waiting in its tp group's rendezvous (its pp group, of one,
    needs nobody), gives up at the mesh's timeout, not new_group's 30 minutes."""
    if rank == 1:
        return
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="(?i)wait timeout"):   # the store's words (FileStore, TCPStore)
        Mesh.build(rank, world, tp=2, timeout=timedelta(seconds=2))
    assert 1.5 < time.perf_counter() - start < 20


def test_a_peer_that_never_comes_ends_the_wait_at_the_timeout(tmp_path):
    run_ranks(_absent_peer_case, 2, tmp_path)
