"""mp/traffic.py: what each rank sends over each group in a step, counted where the programs call
torch.distributed (the summary's sent_mb_per_step, --trace-collectives)."""
import pytest
import torch
import torch.distributed as dist

from helpers import launch, run_ranks
from mp.mesh import Mesh
from mp.traffic import Meter


def every_collective_counted(rank, world, group):
    """4 ranks, tp 2 x cp 2 (the mesh names the groups): each call's bytes by its formula, counted only inside
    counting(), the functions swapped back after."""
    mesh = Mesh.build(rank, world, cp=2, tp=2)
    meter, originals = Meter(), {n: getattr(dist, n) for n in ("all_reduce", "batch_isend_irecv")}
    meter.name_groups(mesh.groups, {name: mesh.peers(name) for name in mesh.groups})
    t = torch.ones(10, 4)                                           # 160 bytes
    dist.all_reduce(t, group=mesh.tp_group)                         # outside: not counted
    with meter.counting(trace=rank == 0):
        dist.all_reduce(t, group=mesh.tp_group)                     # 2 (2-1)/2 x 160 = 160
        out = torch.empty(20, 4)
        dist.all_gather_into_tensor(out, t, group=mesh.cp_group)   # (2-1) x 160 = 160
        dist.reduce_scatter_tensor(torch.empty(5, 4), t, group=mesh.tp_group)   # (2-1)/2 x 160 = 80
        splits = [3, 7] if mesh.tp_rank == 0 else [6, 4]
        got = torch.empty(sum([3, 6] if mesh.tp_rank == 0 else [7, 4]), 4)
        dist.all_to_all_single(got, t, [s for s in ([3, 6] if mesh.tp_rank == 0 else [7, 4])], splits,
                               group=mesh.tp_group)                 # the other rank's rows: 7 or 6 x 16 bytes
        peer = mesh.peers("cp")[1 - mesh.cp_rank]
        ops = [dist.P2POp(dist.isend, t, peer, mesh.cp_group), dist.P2POp(dist.irecv, torch.empty(10, 4), peer,
                                                                           mesh.cp_group)]
        for work in dist.batch_isend_irecv(ops):                   # 160 sent, the receive sends nothing
            work.wait()
        dist.broadcast(t, group_src=0, group=mesh.cp_group)        # 160 from cp rank 0, nothing from rank 1
        dist.all_reduce(torch.ones(1))                              # the default group: "world", 2 x 3/4 x 4 = 6
    assert {n: getattr(dist, n) for n in originals} == originals
    a2a = (7 if mesh.tp_rank == 0 else 6) * 16
    assert meter.bytes == {"tp": 160 + 80 + a2a, "cp": 160 + 160 + (160 if mesh.cp_rank == 0 else 0),
                           "world": 6}, (rank, meter.bytes)
    if rank == 0:
        assert len(meter.trace) == 7 and "all_reduce             on tp {0,1}" in meter.trace[0], meter.trace
        assert "isend [10, 4] float32 to rank 2, sends" in meter.trace[4], meter.trace


def test_every_collective_and_send_is_counted_by_its_group_and_formula(tmp_path):
    run_ranks(every_collective_counted, 4, tmp_path)


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_a_pipeline_sends_its_activations_and_gradients_and_traces_its_first_step(tmp_path, schedule):
    """mlp of width 64 in 2 stages, 16 samples a step: stage 0 sends 16 x 64 floats forward, stage 1 as many
    gradients back: 4,096 bytes a step each, over the pipeline (pp)."""
    args = ["--model", "mlp", "--hidden", "64", "--layers", "4", "--batch-size", "16", "--microbatches", "4",
            "--schedule", schedule, "--data", "synthetic", "--steps", "2", "--eval-every", "0", "--trace-collectives"]
    run = launch("pipeline_microbatch.py", args, tmp_path, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    summary, = run.events("summary")
    assert summary["sent_mb_per_step"]["pp"] == {"0": round(4096 / 2**20, 6), "1": round(4096 / 2**20, 6)}
    trace = run.stdout.split("--trace-collectives: rank 0's step 0")[1].splitlines()[1:]
    sends = [line for line in trace if "batch_isend_irecv" in line]
    assert len(sends) == 4 and all("isend [4, 64] float32 to rank 1, sends 0.0010 MB" in s for s in sends), trace
