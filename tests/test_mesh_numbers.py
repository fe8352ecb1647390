"""The programs moved onto mp/mesh.py keep their numbers: pipeline_dp_joint.py (dp 2 x 2 stages) and
parallel_3d.py (dp 2 x pp 2 x tp 2), with dropout and clipping (the clip at 0.5 acts: every norm is above
it), log within 1e-6 of single_baseline.py in loss and gradient norm, and, where this machine computes the
baseline's recorded numbers bit for bit, exactly the losses and norms they logged before the mesh (recorded
at commit 9319411, the last with the Grid classes, by the same runs)."""
import pytest

from helpers import FAST, launch, slow

ARGS = FAST + ["--model", "mlp", "--hidden", "32", "--layers", "4", "--batch-size", "16", "--steps", "4",
               "--dropout", "0.1", "--clip-grad-norm", "0.5"]

# (loss, grad_norm) of each step, as logged before the mesh
BEFORE = {
    "baseline": [(2.301767587661743, 0.6134868264198303), (2.2798707485198975, 0.5768808126449585),
                 (2.301534414291382, 0.5703938007354736), (2.324199914932251, 0.562133252620697)],
    "joint": [(2.3017674684524536, 0.6134868113840468), (2.279870629310608, 0.5768808148832545),
              (2.3015345335006714, 0.5703937143703736), (2.324199914932251, 0.5621332651910803)],
    "joint --zero 2": [(2.3017674684524536, 0.6134870106042016), (2.279870629310608, 0.5768809957480955),
                       (2.3015345335006714, 0.5703940318092958), (2.324199914932251, 0.5621334787382648)],
    "3d": [(2.3017674684524536, 0.6134869539139343), (2.279870629310608, 0.5768809706865433),
           (2.3015345335006714, 0.5703940360443512), (2.324199914932251, 0.5621334389460079)],
    "3d --zero 3": [(2.3017674684524536, 0.6134870646630367), (2.279870629310608, 0.5768811239488021),
                    (2.3015345335006714, 0.5703940658369547), (2.324199914932251, 0.5621335175666101)],
}
RUNS = {"joint": ("pipeline_dp_joint.py", ["--dp", "2", "--microbatches", "2", "--schedule", "1f1b"], 4),
        "3d": ("parallel_3d.py", ["--dp", "2", "--tp", "2", "--microbatches", "2"], 8)}


def logged(run):
    assert run.returncode == 0, run.stderr[-3000:]
    return [(r["loss"], r["grad_norm"]) for r in run.events("train")]


@pytest.mark.parametrize("name", ["joint", slow("joint --zero 2"), "3d", slow("3d --zero 3")])
def test_the_mesh_keeps_every_number(tmp_path, baseline, name):
    program, layout, nproc = RUNS[name.split()[0]]
    got, base = logged(launch(program, ARGS + layout + name.split()[1:], tmp_path, nproc=nproc)), logged(baseline(ARGS))
    assert len(got) == len(base) == 4
    for (loss, norm), (base_loss, base_norm) in zip(got, base):
        assert abs(loss - base_loss) <= 1e-6 and abs(norm - base_norm) <= 1e-6, (got, base)
        assert base_norm > 0.5                      # the clipping acted on every step
    if base == BEFORE["baseline"]:                  # the same arithmetic as where BEFORE was recorded
        assert got == BEFORE[name]
