"""plot_curves.py draws loss curves and pipeline timelines to PNG files."""
import json

from helpers import FAST, launch

import plot_curves


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
