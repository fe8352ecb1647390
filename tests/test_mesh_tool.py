"""python -m mp.tools.mesh (issue 85): the groups it prints and draws are the ones Mesh.build makes, read back
from its text (the picture and the listing) for listed layouts and for layouts drawn at random (the seed is
printed; MP_MESH_SEED=N reruns one); -o writes a PNG that records them; a bad layout is parallel_5d.py's own
error line, exit 2. parallel_5d.py's start-up lines say the same groups and what a pipeline message carries.
In process, without ranks: Mesh.build with new_group recorded (tests/test_mesh.py)."""
import os
import random
import re
import subprocess

import pytest

from helpers import PYTHON, ROOT
from mp.cli import parallel_5d_args
from mp.mesh import GROUPS, layout, lines
from mp.mesh_picture import SHOWN, label, start_up
from mp.tools import mesh as tool
from mp.tools.figure import png_record
from test_figures import settings
from test_mesh import recorded_meshes

# (argv, world, dp, cp, tp, ep): run_5d.sh's default (ep 2 = the tp pairs), ep over cp x tp and over dp x tp
LISTED = [([], 8, 1, 2, 2, 2),
          (["--world", "16", "--dp", "2", "--cp", "2", "--tp", "2", "--ep", "4"], 16, 2, 2, 2, 4),
          (["--world", "8", "--dp", "2", "--cp", "1", "--tp", "2", "--ep", "4"], 8, 2, 1, 2, 4),
          (["--dp", "2", "--pp", "3", "--cp", "1", "--tp", "1", "--ep", "1"], 6, 2, 1, 1, 1),
          (["--world", "16", "--dp", "4", "--cp", "2", "--tp", "2", "--ep", "8", "--microbatches", "2"],
           16, 4, 2, 2, 8)]
SEED = int(os.environ.get("MP_MESH_SEED", random.randrange(10 ** 6)))
DRAWS = 6


def printed_groups(text, ranks):
    """{group name: its groups} read back from the tool's text: each section's listing, after checking that
    its picture shows every rank under its group's letter."""
    dp, pp, cp, tp = ranks.shape
    found = {}
    for section in text.split("\n\n")[2:]:   # after the heading and the picture of the ranks
        title, *rows = section.splitlines()
        name = next(n for n in SHOWN if title.startswith(f"{label(n)}: "))
        listed = re.findall(r"(\w+) \{([\d,]+)\}", " ".join(r for r in rows if not r.startswith("replica")))
        found[name] = [[int(r) for r in members.split(",")] for _, members in listed]
        letter = {r: name_ for name_, members in listed for r in map(int, members.split(","))}
        pictured = [row.split(":", 1)[1] for row in rows if row.startswith("replica")]
        assert len(pictured) == dp, section
        for d, row in enumerate(pictured):
            cells = [cell.strip() for box in re.findall(r"\[([^\]]*)\]", row) for cell in box.split("|")]
            assert cells == [letter[ranks[d, p, c, t].item()] for p in range(pp) for c in range(cp) for t in range(tp)]
    return found


def assert_the_tool_draws_what_mesh_build_makes(argv, world, dp, cp, tp, ep, monkeypatch, capsys):
    tool.main(argv)
    text = capsys.readouterr().out
    ranks = layout(world, dp, cp, tp)
    found = printed_groups(text, ranks)
    assert sorted(found) == sorted(GROUPS)
    meshes, calls = recorded_meshes(monkeypatch, world, dict(dp=dp, cp=cp, tp=tp), ep)
    for rank, mesh in meshes.items():   # the group Mesh.build made on each rank is the one printed around it
        for name in GROUPS:
            printed = next(group for group in found[name] if rank in group)
            assert mesh.groups[name] == ("group", tuple(printed)), (rank, name, printed)
    assert found == lines(ranks, ep)


@pytest.mark.parametrize("argv,world,dp,cp,tp,ep", LISTED, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_the_tool_prints_the_groups_mesh_build_makes(argv, world, dp, cp, tp, ep, monkeypatch, capsys):
    assert_the_tool_draws_what_mesh_build_makes(argv, world, dp, cp, tp, ep, monkeypatch, capsys)


def draw(rng):
    """A layout parallel_5d.py's parser takes (with --layers 12, so that up to 12 stages fit), at random."""
    while True:
        dp, cp, tp, pp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
        ep = rng.choice([n for n in range(1, dp * cp * tp + 1) if dp * cp * tp % n == 0])
        argv = ["--world", str(dp * pp * cp * tp), "--dp", str(dp), "--cp", str(cp), "--tp", str(tp), "--ep", str(ep),
                "--layers", "12", "--experts", str(ep * 2), "--microbatches", "1"]
        try:
            tool.parse_args(argv)
        except SystemExit:
            continue
        return argv, dp * pp * cp * tp, dp, cp, tp, ep


@pytest.mark.parametrize("index", range(DRAWS))
def test_the_tool_prints_the_groups_of_layouts_drawn_at_random(index, monkeypatch, capsys):
    rng = random.Random(f"mesh tool {SEED} {index}")
    case = draw(rng)
    capsys.readouterr()   # the refusals of the draws that did not fit
    print(f"seed {SEED} (MP_MESH_SEED={SEED} reruns it), draw {index}: python -m mp.tools.mesh {' '.join(case[0])}")
    assert_the_tool_draws_what_mesh_build_makes(*case, monkeypatch, capsys)


def test_o_draws_a_png_that_records_the_groups(tmp_path, capsys):
    out = tmp_path / "mesh.png"
    tool.main(["--world", "16", "--dp", "2", "--cp", "2", "--tp", "2", "--ep", "4", "-o", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    title, record = png_record(str(out))
    assert title.startswith("mesh: 16 ranks") and record["kind"] == "mesh"
    assert record["groups"] == {name: lines(layout(16, 2, 2, 2), 4)[name] for name in SHOWN}


def parser_error(argv, world, capsys):
    """What parallel_5d.py's parser says of argv at this world size: (exit status, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        tool.at_world(world, parallel_5d_args, argv)
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv,world,program_argv", [
    (["--world", "12", "--dp", "2", "--cp", "2", "--tp", "2"], 12, ["--dp", "2", "--cp", "2", "--tp", "2", "--ep", "2",
                                                                  "--experts", "4"]),
    (["--world", "8", "--dp", "2", "--cp", "1", "--tp", "1", "--ep", "4"], 8, ["--dp", "2", "--ep", "4",
                                                                              "--experts", "4"]),
    (["--tp", "8", "--cp", "1", "--world", "16"], 16, ["--tp", "8", "--ep", "2", "--experts", "4"]),
    (["--experts", "3"], 8, ["--cp", "2", "--tp", "2", "--ep", "2", "--experts", "3"]),
])
def test_a_bad_layout_is_parallel_5d_pys_own_error_line(argv, world, program_argv, capsys):
    code, want = parser_error(program_argv, world, capsys)
    with pytest.raises(SystemExit) as exit_:
        tool.main(argv)
    err = capsys.readouterr().err
    assert (exit_.value.code, code) == (2, 2) and err == want and err.startswith("error: ") and err.count("\n") == 1


def test_a_pp_that_does_not_fit_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--world", "8", "--pp", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == ("error: --pp 3 does not fit --world 8: parallel_5d.py runs world / "
                                             "(--dp 1 x --cp 2 x --tp 2) = 2 stages; use --pp 2, or --world 12\n")


def test_the_command_says_one_line_and_exits_2():
    argv = ["--world", "12", "--dp", "2", "--cp", "2", "--tp", "2"]
    run = subprocess.run([PYTHON, "-m", "mp.tools.mesh", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)     # forked from the tests' zygote (tests/python): the parsers import torch
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.startswith("error: the world size 12 is not divisible by --dp 2 x --cp 2 x --tp 2 = 8") \
        and run.stderr.count("\n") == 1, run.stderr


class Messenger:
    """What start_up reads of parallel_3d.CutMessenger: the shapes entering each stage, the scattered cuts."""

    def __init__(self, shapes, scattered, tp):
        self.shapes, self.scattered, self.tp = shapes, set(scattered), tp

    def message_shape(self, cut):
        whole = self.shapes[cut]
        return [whole[0] * whole[1] // self.tp] if cut in self.scattered else list(whole)


def test_the_start_up_lines_say_the_mesh_my_groups_and_the_message(monkeypatch):
    meshes, _ = recorded_meshes(monkeypatch, 8, dict(cp=2, tp=2), 2)
    args = tool.at_world(8, parallel_5d_args, ["--cp", "2", "--tp", "2", "--ep", "2", "--experts", "4"])
    text = start_up(meshes[0], Messenger([(3, 32, 32), (32, 128)], [1], 2), args)
    assert text.splitlines()[0] == ("mesh: 8 ranks = arange(8).view(dp 1, pp 2, cp 2, tp 2) (mp/mesh.py), ep 2 over "
                                    "each stage's dp x cp x tp = 4 ranks")
    assert "replica 0:  [ 0 | 1 ] [ 2 | 3 ] --> [ 4 | 5 ] [ 6 | 7 ]" in text
    assert "rank 0's groups: tp {0,1}  cp {0,2}  pp {0,4}  dp {0}  dp x cp {0,2}  ep {0,1}  edp {0,2}" in text
    assert "python -m mp.tools.mesh --world 8 --dp 1 --cp 2 --tp 2 --ep 2" in text
    assert ("pipeline cut 1 (stage 0 -> 1), a sample's message from rank 0:\n    [2048] = tp rank 0's 1/2 of the "
            "activation [32, 128] = [S/C, H]: cp rank 0's 32 of the S = 64 tokens, width 128") in text
    whole = start_up(meshes[3], Messenger([(3, 32, 32), (16, 128)], [], 2), args)   # --sequence-parallel's cut
    assert "the activation [16, 128] = [S/(C·T), H]: tp rank 1's 16 of cp rank 1's 32 tokens" in whole


def test_the_committed_picture_is_run_5d_shs_mesh_as_the_mesh_builds_it_today():
    """plots/mesh_5d.png (docs/parallel_5d.md) was drawn by `python -m mp.tools.mesh -o plots/mesh_5d.png`,
    whose defaults are run_5d.sh's: a change to either, or to mp.mesh's order, asks for it to be redrawn."""
    knobs = settings("run_5d")
    assert (tool.WORLD, tool.EXPERTS) == (int(knobs["NPROC"]), int(knobs["EXPERTS"]))
    assert tool.DEFAULTS == {axis: int(knobs[axis.upper()]) for axis in tool.DEFAULTS}
    _, record = png_record(os.path.join(ROOT, "plots", "mesh_5d.png"))
    ranks = layout(tool.WORLD, tool.DEFAULTS["dp"], tool.DEFAULTS["cp"], tool.DEFAULTS["tp"])
    assert record["groups"] == {name: lines(ranks, tool.DEFAULTS["ep"])[name] for name in SHOWN}, \
        "redraw it: python -m mp.tools.mesh -o plots/mesh_5d.png"


def test_the_doc_shows_what_the_tool_prints(capsys):
    """docs/parallel_5d.md pastes the default run's mesh as the tool prints it: each part of it, verbatim."""
    tool.main([])
    printed = capsys.readouterr().out
    with open(os.path.join(ROOT, "docs", "parallel_5d.md")) as f:
        doc = f.read()
    stale = [part for part in printed.strip("\n").split("\n\n") if part not in doc]
    assert not stale, f"docs/parallel_5d.md shows an older print of python -m mp.tools.mesh: {stale}"
