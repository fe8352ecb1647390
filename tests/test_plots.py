"""mp.tools.plot_curves draws loss curves and pipeline timelines to PNG files."""
import json
import os

import pytest

from helpers import FAST, launch

from mp.tools import plot_curves, plot_timeline
from mp.tools.figure import plt, png_record


@pytest.fixture(autouse=True)
def close_figures():
    """drawn_figure keeps each figure open to read it: closed after its test, so that the figures of a
    worker's files do not pile up past matplotlib's 20 (its warning, under pytest -n 2)."""
    yield
    plt.close("all")


def test_loss_curves_against_the_baseline(tmp_path, baseline):
    base = baseline(FAST + ["--steps", "6"])
    other = launch("single_baseline.py", FAST + ["--steps", "6", "--lr", "0.03"], tmp_path, log_name="other.jsonl")
    out = tmp_path / "curves.png"
    base_log = tmp_path / "base.jsonl"
    base_log.write_text("".join(json.dumps(r) + "\n" for r in base.records))
    diffs = plot_curves.plot_curves([str(base_log), str(tmp_path / "other.jsonl")], str(out))
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    (label, diff), = diffs.items()
    assert diff == max(abs(a - b) for a, b in zip(other.losses(), base.losses())) > 0


def test_timeline_gantt_from_a_chrome_trace(tmp_path):
    events = []
    for rank in range(2):  # a two-stage GPipe step with two microbatches, drawn by hand
        for i, (cat, mb) in enumerate([("forward", 0), ("forward", 1), ("wait", None), ("backward", 1), ("backward", 0)]):
            events.append({"name": f"{cat}{mb}", "cat": cat, "ph": "X", "ts": 1000 * (i + rank), "dur": 900,
                           "pid": rank, "tid": 0, "args": {"microbatch": mb, "chunk": 0}})
    trace = {"traceEvents": events, "otherData": {"schedule": "gpipe", "stages": 2, "microbatches": 2,
                                                  "virtual_stages": 1, "bubble_measured": 0.4, "bubble_theory": 1 / 3}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    out = tmp_path / "timeline.png"
    plot_curves.main(["--timeline", str(path), str(path), "-o", str(out)])
    assert out.stat().st_size > 10_000


def test_missing_log_is_a_clear_error(tmp_path, capsys):
    try:
        plot_curves.main([str(tmp_path / "absent.jsonl"), "-o", str(tmp_path / "x.png")])
    except SystemExit as e:
        assert e.code == 2
    assert capsys.readouterr().err.startswith("error: ")


def fake_log(path, batch_size=32, steps=5, loss_shift=0.0, evals=(), program="single_baseline", **more):
    """A metrics log written by hand: config, train records, eval records, summary. An evaluation is
    its step (test loss 2.0, accuracy 0.3) or (step, test loss, test accuracy)."""
    args = {"model": "cnn", "data": "synthetic", "seed": 0, "batch_size": batch_size, "lr": 0.02,
            "momentum": 0.9, "steps": steps, "layers": 4, "hidden": 128, "heads": 4, **more}
    records = [{"event": "config", "program": program, "args": args, "world_size": 1}]
    records += [{"event": "train", "step": s, "loss": 2.3 - 0.01 * s + loss_shift} for s in range(steps)]
    records += [{"event": "eval", "step": s, "test_loss": 2.0, "test_acc": 0.3} if isinstance(s, int)
                else {"event": "eval", "step": s[0], "test_loss": s[1], "test_acc": s[2]} for s in evals]
    records.append({"event": "summary", "steps": steps})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def drawn_figure(monkeypatch):
    """Keep the figure plot_curves would save, to read its titles and lines."""
    kept = {}
    for module in (plot_curves, plot_timeline):
        monkeypatch.setattr(module, "save", lambda fig, out, record=None: kept.setdefault("fig", fig))
    return kept


def measured_axes(fig):
    return [a for a in fig.axes if a.get_label().startswith("measured")]


def planned_axes(fig):
    return [a for a in fig.axes if a.get_label().startswith("planned")]


def test_runs_with_different_settings_are_named_not_compared_silently(tmp_path, monkeypatch, capsys):
    kept = drawn_figure(monkeypatch)
    base = fake_log(tmp_path / "base.jsonl", batch_size=32, steps=5)
    other = fake_log(tmp_path / "tp.jsonl", batch_size=64, steps=3, program="tensor_parallel", loss_shift=0.017)
    plot_curves.plot_curves([base, other], str(tmp_path / "x.png"))
    err = capsys.readouterr().err
    assert "batch_size 32 (baseline) vs 64" in err and "steps 5 (baseline) vs 3" in err, err
    title = kept["fig"]._suptitle.get_text()
    assert "NOT COMPARABLE" in title and "batch_size 32 (baseline) vs 64" in title, title
    labels = [t.get_text() for t in kept["fig"].axes[0].get_legend().get_texts()]
    assert any("batch 32" in x for x in labels) and any("batch 64" in x for x in labels), labels


def test_matching_runs_get_the_largest_difference_and_a_line_per_window(tmp_path, monkeypatch, capsys):
    kept = drawn_figure(monkeypatch)
    base = fake_log(tmp_path / "base.jsonl", steps=200, evals=[199])
    other = fake_log(tmp_path / "pp.jsonl", steps=200, evals=[199], program="pipeline_microbatch", loss_shift=3e-7)
    diffs = plot_curves.plot_curves([base, other], str(tmp_path / "x.png"))
    assert "warning" not in capsys.readouterr().err
    assert abs(list(diffs.values())[0] - 3e-7) < 1e-9
    loss_ax, diff_ax, acc_ax = kept["fig"].axes
    assert "largest |loss - baseline| = 3.0e-7: within the contract (1e-4)" in kept["fig"]._suptitle.get_text()
    line = diff_ax.get_lines()[0]
    assert len(line.get_xdata()) == 40 and list(line.get_xdata())[-1] == 199   # 40 windows of 5 steps
    assert acc_ax.get_xlim() == loss_ax.get_xlim()     # one evaluation: a point on the run's step axis


def test_timelines_share_one_axis_and_name_chunks_and_new_categories(tmp_path, monkeypatch):
    kept = drawn_figure(monkeypatch)
    paths = []
    for schedule, v, length in (("1f1b", 1, 4), ("interleaved", 2, 8)):
        events = [{"name": f"{k}{mb}", "cat": cat, "ph": "X", "ts": 1000 * i, "dur": 900, "pid": 0, "tid": 0,
                   "args": {"microbatch": mb, "chunk": i % v}}
                  for i, (k, cat, mb) in enumerate([("F", "forward", 0), ("B", "backward", 0), ("W", "weight", 0),
                                                    ("F", "forward", 1)] * (length // 4))]
        path = tmp_path / f"{schedule}.json"
        path.write_text(json.dumps({"traceEvents": events, "otherData": {
            "schedule": schedule, "stages": 4, "microbatches": 2, "virtual_stages": v, "bubble_measured": 0.6,
            "bubble_theory": 0.4, "device": "cpu", "cpu_cores": 2}}))
        paths.append(str(path))
    plot_timeline.plot_timelines(paths, str(tmp_path / "t.png"))
    top, bottom = measured_axes(kept["fig"])
    assert top.get_xlim() == bottom.get_xlim()                       # the shorter schedule looks shorter
    assert {"F0", "B0", "W0"} <= {t.get_text() for t in top.texts}
    assert {"F0a", "B0b", "W0a", "F1b"} <= {t.get_text() for t in bottom.texts}
    legend = [t.get_text() for t in planned_axes(kept["fig"])[0].get_legend().get_texts()]
    assert legend[:3] == ["forward", "backward", "weight gradient (W)"] and "measured: not timed" in legend[-1], legend
    assert "the 4 ranks shared 2 CPU cores" in kept["fig"]._suptitle.get_text()


def fake_trace(path, busy_per_rank, chunks=1, dur_wait=2000, **other):
    """A trace with one F and one B per rank and chunk, each lasting busy_per_rank[rank] / 2 ms per chunk."""
    events, clock = [], 0
    for rank, busy in enumerate(busy_per_rank):
        for chunk in range(chunks):
            for k, cat in (("F", "forward"), ("B", "backward")):
                dur = busy * 1000 / 2 / chunks
                events.append({"name": f"{k}0", "cat": cat, "ph": "X", "ts": clock, "dur": dur, "pid": rank, "tid": 0,
                               "args": {"microbatch": 0, "chunk": chunk}})
                clock += dur
        events.append({"name": "wait", "cat": "wait", "ph": "X", "ts": clock, "dur": dur_wait, "pid": rank, "tid": 0})
        clock += dur_wait
    path.write_text(json.dumps({"traceEvents": events, "otherData": {
        "schedule": "1f1b", "stages": len(busy_per_rank), "microbatches": 1, "virtual_stages": chunks,
        "bubble_measured": 0.5, "bubble_theory": 0.4, "device": "cpu", "cpu_cores": 8, **other}}))
    return str(path)


def test_a_trace_given_as_a_metrics_log_and_back_is_one_error_line(tmp_path, capsys):
    trace = fake_trace(tmp_path / "t.json", [1, 1])
    log = fake_log(tmp_path / "log.jsonl")
    for argv, hint in (([trace], "draw it with --timeline"), (["--timeline", log], "draw it without --timeline")):
        try:
            plot_curves.main(argv + ["-o", str(tmp_path / "x.png")])
            raise AssertionError("no error")
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and hint in err[0], err
    assert not (tmp_path / "x.png").exists()


def test_unequal_stages_are_named_in_the_title_and_equal_ones_are_not(tmp_path, monkeypatch):
    kept = drawn_figure(monkeypatch)
    unequal = fake_trace(tmp_path / "u.json", [6, 2, 2, 2])
    equal = fake_trace(tmp_path / "e.json", [2, 2, 2.2, 2], recompute=True)
    plot_timeline.plot_timelines([unequal, equal], str(tmp_path / "t.png"))
    top, bottom = measured_axes(kept["fig"])
    assert "stages unequal: rank 0 computes 6.0 ms a step, rank 1 2.0 ms (3.0x)" in top.get_title(), top.get_title()
    assert "unequal" not in bottom.get_title() and bottom.get_title().startswith("1f1b, --recompute: 4 stages")
    assert "CPU cores" not in kept["fig"]._suptitle.get_text()      # 4 ranks on 8 cores: no core contention


def test_interleaved_chunks_are_hatched_and_names_that_do_not_fit_are_left_out(tmp_path, monkeypatch):
    kept = drawn_figure(monkeypatch)
    # rank 0's boxes are 100 times shorter than rank 1's, on a one-step axis of about 2 s
    path = fake_trace(tmp_path / "i.json", [0.04, 4], chunks=2, dur_wait=2_000_000)
    plot_timeline.plot_timelines([path], str(tmp_path / "t.png"))
    ax, = measured_axes(kept["fig"])
    boxes = [p for p in ax.patches if p.get_height() == 0.8]
    assert {str(p.get_hatch() or "") for p in boxes} == {"", plot_timeline.HATCHES[1]}   # chunk a plain, b hatched
    texts = {(t.get_text(), round(t.get_position()[1])) for t in ax.texts}
    assert texts == set(), texts                                     # 2 s of axis: no box is wide enough
    path = fake_trace(tmp_path / "j.json", [0.04, 4], chunks=2, dur_wait=2000)
    kept.clear()
    plot_timeline.plot_timelines([path], str(tmp_path / "t.png"))
    ax, = measured_axes(kept["fig"])
    texts = {(t.get_text(), round(t.get_position()[1])) for t in ax.texts}
    assert texts == {("F0a", 1), ("B0a", 1), ("F0b", 1), ("B0b", 1)}, texts   # rank 1's fit, rank 0's do not
    legend = [t.get_text() for t in planned_axes(kept["fig"])[0].get_legend().get_texts()]
    assert any(x.startswith("hatched") and "chunk b" in x for x in legend), legend


def test_each_timeline_is_drawn_beside_its_plan_and_the_title_says_why_they_differ(tmp_path, monkeypatch):
    from mp.pp.schedules import clock_cells
    trace = fake_trace(tmp_path / "g.json", [1, 1, 1, 1], schedule="gpipe", microbatches=4, bubble_measured=0.85,
                       bubble_theory=3 / 7, cpu_cores=2)
    out = tmp_path / "t.png"
    plot_curves.main(["--timeline", trace, "-o", str(out)])
    _, record = png_record(str(out))
    assert record["traces"][0]["planned"] == {"ticks": 14, "idle": pytest.approx(3 / 7)}
    kept = drawn_figure(monkeypatch)
    plot_timeline.plot_timelines([trace], str(out))
    plan, = planned_axes(kept["fig"])
    cells = [cell for row in clock_cells("gpipe", 4, 4) for cell in row if cell != "."]
    assert len([p for p in plan.patches if round(p.get_height(), 9) == 0.8]) == len(cells) == 32   # a box per F and B
    assert sorted(t.get_text() for t in plan.texts) == sorted(cells)                    # each named
    assert plan.get_xlim() == (0, 14) and "idle 42.9%" in plan.get_title(), plan.get_title()
    title = kept["fig"]._suptitle.get_text().replace("\n", " ")
    assert "gpipe 85% measured against 43% planned" in title, title
    assert "the 4 ranks shared 2 CPU cores" in title and "waited for a free core" in title, title


def test_2bw_gets_a_time_axis_of_its_own_and_does_not_squeeze_the_others(tmp_path, monkeypatch):
    kept = drawn_figure(monkeypatch)
    short = fake_trace(tmp_path / "a.json", [1, 1, 1, 1])
    longer = fake_trace(tmp_path / "b.json", [2, 2, 2, 2])
    pipedream = fake_trace(tmp_path / "c.json", [20, 20, 20, 20], schedule="2bw", microbatches=4, steps=2)
    plot_timeline.plot_timelines([short, longer, pipedream], str(tmp_path / "t.png"))
    a, b, c = measured_axes(kept["fig"])
    spans = [plot_timeline.span_ms(plot_timeline.read_trace(t)) for t in (short, longer, pipedream)]
    assert a.get_xlim() == b.get_xlim() == pytest.approx((-0.02 * spans[1], 1.02 * spans[1]))   # one-step charts
    assert c.get_xlim() == pytest.approx((-0.02 * spans[2], 1.02 * spans[2])) and spans[2] > 3 * spans[1]
    assert "its own axis" in c.get_xlabel() and "steady" in planned_axes(kept["fig"])[2].get_title()


def test_loss_axes_show_whole_steps(tmp_path, monkeypatch):
    kept = drawn_figure(monkeypatch)
    base = fake_log(tmp_path / "base.jsonl", steps=3, evals=[2])
    other = fake_log(tmp_path / "pp.jsonl", steps=3, evals=[2], program="pipeline_microbatch")
    plot_curves.plot_curves([base, other], str(tmp_path / "x.png"))
    for ax in kept["fig"].axes:        # a 3-step run would get ticks at 0.25, 0.5, ... without the locator
        assert all(float(t).is_integer() for t in ax.get_xticks()), (ax.get_title(), ax.get_xticks())


def test_ctrl_c_while_drawing_keeps_the_old_png_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    import matplotlib.figure
    base = fake_log(tmp_path / "base.jsonl")
    out = tmp_path / "x.png"
    out.write_bytes(b"the figure of an earlier run")

    def interrupted(fig, path, **kwargs):      # half a PNG written, then Ctrl-C
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", interrupted)
    with pytest.raises(SystemExit) as exit_:
        plot_curves.main([base, "-o", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 130 and err == [f"interrupted: {out} not written"], err
    assert out.read_bytes() == b"the figure of an earlier run"
    assert sorted(os.listdir(tmp_path)) == ["base.jsonl", "x.png"]              # no partial file left
    monkeypatch.undo()
    plot_curves.main([base, "-o", str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG" and sorted(os.listdir(tmp_path)) == ["base.jsonl", "x.png"]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_figure_gets_the_mode_the_users_umask_gives(tmp_path, umask):
    """Issue 47: a figure is written as open() writes a file (0644 under umask 022), not as mkstemp's 0600,
    which a grader logged in as another user could not open; the logs already are."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mp.tools.figure import save
    before = os.umask(umask)
    try:
        fig, ax = plt.subplots()
        ax.plot([0, 1])
        save(fig, str(tmp_path / "f.png"))
        with open(tmp_path / "plain.txt", "w") as f:    # what the user's other files get
            f.write("x")
    finally:
        os.umask(before)
    assert os.stat(tmp_path / "f.png").st_mode & 0o777 == os.stat(tmp_path / "plain.txt").st_mode & 0o777 \
        == 0o666 & ~umask


def colour_pixels(fig, ax, colour):
    """How many pixels inside ax are drawn in colour (the legend taken away first: its swatches
    would show a colour that the curves hide)."""
    import numpy as np
    from matplotlib.colors import to_rgb
    if ax.get_legend():
        ax.get_legend().remove()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    box = ax.get_window_extent()
    top = image.shape[0] - int(box.y1)                   # the buffer's rows run from the top
    inside = image[top:image.shape[0] - int(box.y0), int(box.x0):int(box.x1)]
    target = np.array([round(255 * c) for c in to_rgb(colour)])
    return int((np.abs(inside - target).sum(axis=-1) < 30).sum())


def test_bit_identical_runs_are_each_visible_and_the_legend_names_the_twin(tmp_path, monkeypatch):
    """GPipe's and 1F1B's losses are bit-identical: the run drawn second must not hide the first, and
    the legend says which run it repeats; a run equal to the baseline says so; a run 1e-7 away from
    another is not called identical."""
    kept = drawn_figure(monkeypatch)
    base = fake_log(tmp_path / "base.jsonl", steps=300, evals=range(49, 300, 50))
    pp = lambda name, schedule, shift: fake_log(tmp_path / name, steps=300, evals=range(49, 300, 50),
                                                program="pipeline_microbatch", schedule=schedule, loss_shift=shift)
    runs = [base, pp("gpipe.jsonl", "gpipe", 3e-7), pp("1f1b.jsonl", "1f1b", 3e-7), pp("zb.jsonl", "zb", 4e-7),
            fake_log(tmp_path / "tp.jsonl", steps=300, evals=range(49, 300, 50), program="tensor_parallel")]
    plot_curves.plot_curves(runs, str(tmp_path / "x.png"))
    loss_ax, diff_ax, acc_ax = kept["fig"].axes
    legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    gpipe, one_f_one_b, zb, tp = legend[1:]
    assert "identical" not in gpipe and "identical" not in zb, legend
    assert "identical to pipeline_microbatch (gpipe, batch 32)" in one_f_one_b, legend
    assert "= baseline" in tp, legend
    for ax in (loss_ax, diff_ax, acc_ax):                                   # gpipe's line and 1f1b's differ
        first, second = ([line for line in ax.get_lines() if line.get_label().startswith(f"pipeline_microbatch ({s}")]
                         for s in ("gpipe", "1f1b"))
        assert len(first) == len(second) == 1 and first[0].get_marker() != second[0].get_marker(), ax.get_title()
    for colour in ("C0", "C1"):                                             # gpipe's and 1f1b's colours both show
        assert colour_pixels(kept["fig"], loss_ax, colour) > 100, colour


def test_a_few_evaluations_are_points_with_a_note_saying_what_they_mean(tmp_path, monkeypatch):
    """60 steps, an evaluation every 50: two points, accuracy down while the test loss falls. They are
    drawn as points (no line claiming a trend) under a note that says why they may disagree; six
    evaluations are a curve with no note."""
    kept = drawn_figure(monkeypatch)
    evals = [(49, 2.10, 0.31), (59, 2.02, 0.28)]
    base = fake_log(tmp_path / "base.jsonl", steps=60, evals=evals)
    other = fake_log(tmp_path / "pp.jsonl", steps=60, evals=evals, program="pipeline_microbatch", loss_shift=3e-7)
    plot_curves.plot_curves([base, other], str(tmp_path / "x.png"))
    acc_ax = kept["fig"].axes[2]
    note = " ".join(acc_ax.get_legend().get_title().get_text().split())   # the note heads the panel's legend
    assert "2 evaluations (steps 49, 59): too few to show a trend" in note, note
    assert "test loss 2.1 -> 2.02" in note and "accuracy 31.0% -> 28.0%" in note, note
    assert all(line.get_linestyle() == "None" for line in acc_ax.get_lines() if line.get_marker() not in ("", "None"))
    kept.clear()
    six = [(s, 2.0, 0.3) for s in range(49, 300, 50)]
    base = fake_log(tmp_path / "base6.jsonl", steps=300, evals=six)
    plot_curves.plot_curves([base, fake_log(tmp_path / "pp6.jsonl", steps=300, evals=six)], str(tmp_path / "x.png"))
    acc_ax = kept["fig"].axes[2]
    assert not acc_ax.get_legend().get_title().get_text()
    assert all(line.get_linestyle() != "None" for line in acc_ax.get_lines())


@pytest.mark.parametrize("steps,evals,beside,program", [
    (100, [49, 99], False, "pipeline_microbatch"),       # DATA=synthetic STEPS=100: two evaluations and the note
    (100, [49, 99], True, "pipeline_microbatch"),        # 2bw's figure: its reference and a run drawn beside
    (30, [29], False, "context_parallel"), (5, [], False, "tensor_parallel"),
    (300, range(49, 300, 50), False, "pipeline_dp_joint"), (1000, range(99, 1000, 100), True, "parallel_3d")])
def test_no_legend_covers_a_note_a_curve_or_another_legend(tmp_path, monkeypatch, steps, evals, beside, program):
    """Issue 59: at any --steps, every legend lies outside every panel's data area (where the curves
    and the points are), inside the figure, clear of the other legends; the accuracy note is the
    title of its panel's legend. Boxes in pixels, after the layout save() gives the figure."""
    kept = drawn_figure(monkeypatch)
    long = dict(schedule="interleaved", virtual_stages=2, microbatches=8)   # a long label, twice (identical)
    runs = [fake_log(tmp_path / "base.jsonl", steps=steps, evals=evals)] + [
        fake_log(tmp_path / f"{k}.jsonl", steps=steps, evals=evals, program=program, **long) for k in range(2)]
    others = [fake_log(tmp_path / "other.jsonl", steps=steps, evals=evals, loss_shift=0.1)] if beside else []
    plot_curves.plot_curves(runs, str(tmp_path / "x.png"), beside=others)
    assert_legends_clear(kept["fig"])


def assert_legends_clear(fig):
    fig.tight_layout()                                   # as save() does
    fig.canvas.draw()
    whole = fig.bbox
    legends = [a.get_legend() for a in fig.axes]
    assert all(legends), "every panel has a legend"
    boxes = [legend.get_window_extent() for legend in legends]
    for i, box in enumerate(boxes):
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, \
            f"legend {i} leaves the figure: {box} in {whole}"
        for j, ax in enumerate(fig.axes):
            assert not box.overlaps(ax.get_window_extent()), f"legend {i} covers panel {j}"
            assert not any(box.overlaps(t.get_window_extent()) for t in ax.texts), f"legend {i} covers a note"
        for k, other in enumerate(boxes[:i]):
            assert not box.overlaps(other), f"legends {k} and {i} overlap"


def expert_log(path, program, shift=0.0, parted_at=None, breach_at=None, world=1, steps=300, evals=range(49, 300, 50),
               drift=0.0, **more):
    """A mixture of experts' log by hand: the routing record (tokens per expert, per block, per step) in
    the summary; parted_at: from that step on, one token goes to another expert and the losses part;
    breach_at: one loss moved by 1e-3 there (a doctored log: the routing still the baseline's); drift: after
    parted_at the loss moves away by this much more a step (a run that trains off); more: the program's other flags."""
    p = fake_log(path, steps=steps, evals=evals, program=program, **{"model": "vit", "experts": 4, "top_k": 1, **more})
    records = [json.loads(line) for line in open(p)]
    for r in records:
        if r["event"] == "config":
            r["world_size"] = world
        if r["event"] == "train":
            r["loss"] += shift + ((1e-5 + drift) * (r["step"] - parted_at + 1) if parted_at is not None
                                  and r["step"] >= parted_at else 0) + (1e-3 if r["step"] == breach_at else 0)
        if r["event"] == "summary":
            r["tokens_per_expert"] = [[[40 + (s * 7 + e * 3) % 11 + (s >= (parted_at or steps) and e < 2) * (1 - 2 * e)
                                        for e in range(4)] for _ in range(2)] for s in range(steps)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_run_that_breaks_the_contract_is_named_with_its_step_and_exits_1(tmp_path, capsys):
    """Issue 67, item 1: a log with one loss moved by 1e-3 is drawn, then named with the step, exit 1;
    the same after the routing first differs is what a tipped near-tie does: reported, exit 0."""
    base = fake_log(tmp_path / "base.jsonl", steps=40)
    doctored = fake_log(tmp_path / "tp.jsonl", steps=40, program="tensor_parallel", loss_shift=3e-7)
    records = [json.loads(line) for line in open(doctored)]
    for r in records:
        if r["event"] == "train" and r["step"] == 17:
            r["loss"] += 1e-3
    with open(doctored, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with pytest.raises(SystemExit) as e:
        plot_curves.main([base, str(doctored), "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and (tmp_path / "x.png").exists(), err          # drawn, then refused
    assert err.splitlines()[-1].startswith("contract broken: tensor_parallel (batch 32) logged |loss - baseline| "
                                           "= 1.0e-3 at step 17, over the 1e-4 of the equivalence contract"), err
    assert png_record(str(tmp_path / "x.png"))[0].splitlines()[0].startswith("CONTRACT BROKEN")   # the verdict first
    # a mixture of experts: held to the contract before its routing first differs, not after
    eb = expert_log(tmp_path / "eb.jsonl", "single_baseline")
    plot_curves.main([eb, expert_log(tmp_path / "ep.jsonl", "expert_parallel", 3e-7, parted_at=219, world=2),
                      "-o", str(tmp_path / "ep.png")])
    out = capsys.readouterr().out
    assert "3.0e-7 until routing first differs at step 219: the contract (1e-4) holds there" in out, out
    title = png_record(str(tmp_path / "ep.png"))[0]
    assert title.startswith("PASS: exact to 3.0e-7 (contract 1e-4) until routing first differs at step 219"), title
    assert "train alike (20-step means within 7.2e-4, band 0.01)" in title, title
    # after the routing parts the runs are held to the band of their running means: one that trains off leaves it
    with pytest.raises(SystemExit) as e:
        plot_curves.main([eb, expert_log(tmp_path / "ep3.jsonl", "expert_parallel", 3e-7, parted_at=219, world=2,
                                         drift=0.05), "-o", str(tmp_path / "ep3.png")])
    assert e.value.code == 1 and "running mean of the loss is" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        plot_curves.main([eb, expert_log(tmp_path / "ep2.jsonl", "expert_parallel", 3e-7, parted_at=219,
                                         breach_at=100, world=2), "-o", str(tmp_path / "ep2.png")])
    assert e.value.code == 1 and "at step 100" in capsys.readouterr().err


def test_the_expert_figure_is_two_rows_of_two_in_plain_words(tmp_path, monkeypatch):
    """Issue 67, item 3: four panels as 2 x 2, at most 2.5 wide for 1 high; every x-axis says "step";
    the load panel says whose routing it draws and where the other run's first differs, which the
    difference panel marks too; the baseline's accuracy shows around the parallel run's; a window of
    exact zeros is a gap, not a dip to 1e-12."""
    kept = drawn_figure(monkeypatch)
    eb = expert_log(tmp_path / "eb.jsonl", "single_baseline")
    plot_curves.plot_curves([eb, expert_log(tmp_path / "ep.jsonl", "expert_parallel", parted_at=219, world=2)],
                            str(tmp_path / "x.png"))
    fig = kept["fig"]
    width, height = fig.get_size_inches()
    loss_ax, diff_ax, acc_ax, load_ax = fig.axes
    assert width / height <= 2.5 and loss_ax.get_position().y0 > acc_ax.get_position().y1, (width, height)
    assert {a.get_xlabel() for a in fig.axes} == {"step"}
    assert "as single_baseline routed them" in load_ax.get_title(), load_ax.get_title()
    assert "expert_parallel: the same until step 218, differs from step 219" in load_ax.get_title()
    assert "run(s)" not in load_ax.get_title()
    assert any(list(line.get_xdata()) == [219, 219] for line in diff_ax.get_lines()), "step 219 marked"
    curve = diff_ax.get_lines()[0].get_ydata()
    assert all(y != y for y in curve[:27]) and min(y for y in curve if y == y) > 1e-8   # zeros: gaps (NaN)
    base_ring, parallel_dots = acc_ax.get_lines()[:2]
    assert base_ring.get_markersize() > parallel_dots.get_markersize() + 4 and base_ring.get_markerfacecolor() == "none"
    assert_legends_clear(fig)                             # the top row's legends between the rows, clear of both


def test_a_5d_runs_long_label_stays_inside_the_figure(tmp_path, monkeypatch):
    """run_5d.sh's figure (the 2x2 panels with the experts' load): parallel_5d's label runs to 100 characters;
    unwrapped, its legend, centred under a 6-inch panel, reached past the figure's left edge."""
    kept = drawn_figure(monkeypatch)
    five = dict(schedule="1f1b", attention="ring", dp=1, cp=2, tp=2, ep=2, microbatches=2, top_k=2)
    plot_curves.plot_curves([expert_log(tmp_path / "eb.jsonl", "single_baseline", steps=100, evals=[49, 99],
                                        microbatches=2, top_k=2),
                             expert_log(tmp_path / "5d.jsonl", "parallel_5d", world=8, steps=100, evals=[49, 99],
                                        parted_at=63, **five)], str(tmp_path / "x.png"))
    assert len(kept["fig"].axes) == 4
    assert_legends_clear(kept["fig"])
