"""mp/mesh.py without processes: the layout, every group's members and my coordinates, checked against
literal tables; every rank makes its own group of each name in one order (new_group recorded, not run);
sizes that do not fit are refused before any group is made. With processes (4 gloo ranks): the groups, each its own,
share the world group's one event-loop thread."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers import run_ranks
from mp import mesh as mesh_module
from mp.mesh import GROUPS, SHARED_GLOO, Mesh, layout, lines
import pipeline_dp_joint

# 16 ranks, dp 2 pp 2 cp 2 tp 2: rank = dp * 8 + pp * 4 + cp * 2 + tp (the module docstring's picture)
SIXTEEN = {
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "dp_cp": [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]],
}
# ep folded over a stage's dp x cp x tp ranks in (dp, cp, tp) order: stage 0's are 0 1 2 3 8 9 10 11
SIXTEEN_EP4 = dict(SIXTEEN, ep=[[0, 1, 2, 3], [8, 9, 10, 11], [4, 5, 6, 7], [12, 13, 14, 15]],
                   edp=[[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]])
SIXTEEN_EP2 = dict(SIXTEEN, ep=[[0, 1], [2, 3], [8, 9], [10, 11], [4, 5], [6, 7], [12, 13], [14, 15]],
                   edp=[[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]])
# 8 ranks, dp 2 pp 2 tp 2 (parallel_3d.py's grid): rank = dp * 4 + pp * 2 + tp; cp of 1
EIGHT_EP2 = {
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "cp": [[r] for r in range(8)],
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp_cp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "ep": [[0, 1], [4, 5], [2, 3], [6, 7]],       # a tp pair: the closest ranks
    "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}
# 6 ranks, dp 2 (pipeline_dp_joint.py's default grid): 2 pipelines of 3 stages
SIX = {"pp": [[0, 1, 2], [3, 4, 5]], "dp": [[0, 3], [1, 4], [2, 5]], "cp": [[r] for r in range(6)],
       "tp": [[r] for r in range(6)], "dp_cp": [[0, 3], [1, 4], [2, 5]], "ep": [[0], [3], [1], [4], [2], [5]],
       "edp": [[0, 3], [1, 4], [2, 5]]}

SHAPES = [(16, dict(dp=2, cp=2, tp=2), 4, SIXTEEN_EP4), (16, dict(dp=2, cp=2, tp=2), 2, SIXTEEN_EP2),
          (8, dict(dp=2, tp=2), 2, EIGHT_EP2), (6, dict(dp=2), 1, SIX)]


@pytest.mark.parametrize("world,sizes,ep,table", SHAPES)
def test_every_group_holds_the_ranks_of_the_table(world, sizes, ep, table):
    found = lines(layout(world, **sizes), ep)
    assert list(found) == list(GROUPS)
    assert found == table


def test_the_numbering_is_the_one_the_two_grids_had():
    """view(dp, pp) and view(dp, pp, tp) with the axes of one added: every rank keeps its coordinates."""
    assert layout(6, dp=2).flatten(1).tolist() == torch.arange(6).view(2, 3).tolist()
    assert layout(8, dp=2, tp=2).squeeze(2).tolist() == torch.arange(8).view(2, 2, 2).tolist()
    assert layout(16, dp=2, cp=2, tp=2)[1, 0, 1, 0].item() == 10       # ((1 * 2 + 0) * 2 + 1) * 2 + 0


def recorded_meshes(monkeypatch, world, sizes, ep):
    """Mesh.build on every rank, new_group replaced by a recorder: ({rank: mesh}, {rank: the calls})."""
    calls = {}

    def build(rank):
        calls[rank] = []

        def new_group(ranks, timeout, desc=None):
            calls[rank].append((list(ranks), timeout))
            return ("group", tuple(ranks))          # stands for the process group of these ranks
        monkeypatch.setattr(mesh_module, "new_group", new_group)
        return Mesh.build(rank, world, ep=ep, timeout="T", **sizes)
    return {rank: build(rank) for rank in range(world)}, calls


@pytest.mark.parametrize("world,sizes,ep,table", SHAPES)
def test_every_rank_makes_its_own_groups_in_the_same_order(monkeypatch, world, sizes, ep, table):
    meshes, calls = recorded_meshes(monkeypatch, world, sizes, ep)
    for rank in range(world):    # my line of pp, dp, cp, tp, dp x cp, ep, edp (tests/test_mesh_setup.py counts)
        assert calls[rank] == [(next(line for line in table[name] if rank in line), "T") for name in GROUPS]
    for rank, mesh in meshes.items():
        for name in GROUPS:                         # my group along each axis: the one whose line holds me
            assert mesh.groups[name] == ("group", tuple(mesh.peers(name))) and rank in mesh.peers(name)
        assert mesh.dp_group is mesh.groups["dp"] and mesh.edp_group is mesh.groups["edp"]
        assert mesh.timeout == "T"


@pytest.mark.parametrize("world,sizes,ep,table", SHAPES)
def test_my_coordinates_give_back_my_rank(monkeypatch, world, sizes, ep, table):
    meshes, _ = recorded_meshes(monkeypatch, world, sizes, ep)
    for rank, m in meshes.items():
        assert ((m.dp_rank * m.pp_size + m.pp_rank) * m.cp_size + m.cp_rank) * m.tp_size + m.tp_rank == rank
        assert m.dp_cp_rank == m.dp_rank * m.cp_size + m.cp_rank           # my (dp, cp) slice of a batch
        plane = m.dp_cp_rank * m.tp_size + m.tp_rank                       # my place in the stage's (dp, cp, tp)
        assert (m.edp_rank, m.ep_rank) == divmod(plane, m.ep_size)          # ep innermost in it
        assert m.ep_size * m.edp_size == m.dp_cp_size * m.tp_size == m.dp_size * m.cp_size * m.tp_size
        assert m.ranks.shape == (m.dp_size, m.pp_size, m.cp_size, m.tp_size)


def test_rank_10_of_sixteen(monkeypatch):
    meshes, _ = recorded_meshes(monkeypatch, 16, dict(dp=2, cp=2, tp=2), 2)
    m = meshes[10]
    assert (m.dp_rank, m.pp_rank, m.cp_rank, m.tp_rank, m.ep_rank, m.edp_rank) == (1, 0, 1, 0, 0, 3)
    assert (m.peers("dp"), m.peers("cp"), m.peers("dp_cp"), m.peers("ep"), m.peers("edp")) == \
        ([2, 10], [8, 10], [0, 2, 8, 10], [10, 11], [0, 2, 8, 10])


def test_the_pipeline_of_a_rank_is_its_pp_line(monkeypatch):
    meshes, _ = recorded_meshes(monkeypatch, 6, dict(dp=2), 1)
    pos = pipeline_dp_joint.pipeline(meshes[4], 2, "v")
    assert (pos.pp_rank, pos.pp_size, pos.ranks, pos.virtual, pos.placement) == (1, 3, [3, 4, 5], 2, "v")
    assert pos.group == ("group", (3, 4, 5)) and (pos.prev_rank, pos.next_rank) == (3, 5)


@pytest.mark.parametrize("world,sizes,ep,message", [
    (16, dict(dp=2, cp=2, tp=2), 3, "ep 3 does not divide dp 2 x cp 2 x tp 2 = 8"),
    (8, dict(dp=2, tp=2), 3, "ep 3 does not divide dp 2 x cp 1 x tp 2 = 4"),
    (8, dict(dp=3), 1, "the world size 8 is not divisible by dp 3 x cp 1 x tp 1 = 3"),
])
def test_sizes_that_do_not_fit_are_refused_before_any_group(monkeypatch, world, sizes, ep, message):
    made = []
    monkeypatch.setattr(mesh_module, "new_group", lambda *a, **kw: made.append(a))
    with pytest.raises(ValueError, match=message):
        Mesh.build(0, world, ep=ep, **sizes)
    assert made == []


def _one_loop_case(rank, world, group):
    """dp 2 x tp 2 on gloo: every group sums over its own members, on one loop thread a rank (torch's own
    gloo groups bring one each: 8 here), and keeps the timeout it was made with."""
    mesh = Mesh.build(rank, world, dp=2, tp=2, timeout=timedelta(seconds=77))
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    assert threads.count("gloo_tcp_loop") == 1, threads
    for name in GROUPS:
        mine = mesh.groups[name]
        assert dist.get_backend(mine) == SHARED_GLOO
        assert mine._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=77)
    # dp and dp x cp have the same members (cp is 1) and stay two groups: both in flight at once
    sums = {name: torch.tensor([rank + 1.0]) for name in ("dp", "dp_cp", "tp", "pp")}
    works = [dist.all_reduce(t, group=mesh.groups[name], async_op=True) for name, t in sums.items()]
    for work in works:
        work.wait()
    assert mesh.dp_group is not mesh.dp_cp_group
    for name, t in sums.items():
        assert t.item() == sum(r + 1 for r in mesh.peers(name)), (name, t)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are counted in /proc (Linux)")
def test_the_groups_share_one_event_loop(tmp_path):
    run_ranks(_one_loop_case, 4, tmp_path)
