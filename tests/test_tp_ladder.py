"""benchmarks/tp_ladder.py, the course's ladder on Sequential(linear1, relu, linear2): every rung
equals the full layers, and the collectives it counts are the ones docs/tensor_parallel.md explains
(the column + row pair in one round, column-only in three)."""
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tp_ladder  # noqa: E402


@pytest.mark.slow
def test_each_rung_equals_the_full_layers_and_the_pair_needs_one_all_reduce():
    result = tp_ladder.ladder(tp_ladder.parse_args(["--steps", "5", "--batch-size", "16", "--hidden", "32"]))
    table = result["table"]
    assert all(row["largest_difference"] < 1e-5 for row in table.values()), table
    calls = {name.split()[0]: row["calls"] for name, row in table.items()}
    assert calls["1"] == {"forward all_gather": 1} and calls["1b"] == {"forward all_reduce": 1}
    assert calls["2"] == {"forward all_reduce": 1}                       # one round: the images need no gradient
    assert calls["2b"] == {"forward all_gather": 2, "backward all_reduce": 1}
    assert calls["3"] == {"forward all_reduce": 1, "forward all_gather": 1, "backward all_reduce": 1}
    assert table["2 Sequential, column + row"]["elements"] == {"forward all_reduce": 16 * 10}
    full = result["losses"]["full"]
    for name in ("pair", "column-only"):
        assert max(abs(a - b) for a, b in zip(result["losses"][name], full)) < 1e-5


def test_the_difference_panel_draws_the_contract_line_and_whole_steps(tmp_path):
    losses = {"full": [2.3, 2.0, 1.8], "pair": [2.3, 2.0 + 3e-4, 1.8], "column-only": [2.3, 2.0, 1.8 + 1e-6]}
    args = tp_ladder.parse_args(["--steps", "3"])
    out = tmp_path / "ladder.png"
    fig = tp_ladder.plot({"table": {}, "losses": losses}, args, str(out))
    left, right = fig.axes
    contract = [line for line in right.get_lines() if list(line.get_ydata()) == [1e-4, 1e-4]]
    assert len(contract) == 1 and "1e-4" in contract[0].get_label() and "contract" in contract[0].get_label()
    assert any("1e-4" in t.get_text() for t in right.get_legend().get_texts())   # named where it is read
    for ax in (left, right):
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()
    from mp.tools.figure import png_record
    _, record = png_record(str(out))
    assert record["contract"] == 1e-4 and record["largest_difference"]["pair"] == pytest.approx(3e-4)
