"""benchmarks/bench.py on tiny sizes: the harness runs, and its engines agree with PyTorch's own
(torch.distributed.pipelining, torch.distributed.tensor.parallel) step by step, which makes
PyTorch's engines an independent oracle for ours."""
import json
import re

import pytest

from helpers import launch

TINY = ["--layers", "8", "--hidden", "32", "--batch-size", "24", "--warmup", "1", "--repeat", "3"]


def bench(tmp_path, what, nproc, extra=()):
    out = tmp_path / f"{what}.json"
    run = launch("benchmarks/bench.py", [what, "--out", str(out), *TINY, *extra], tmp_path, nproc=nproc)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_our_pipeline_schedules_step_like_torch_pipelining(tmp_path):
    result = bench(tmp_path, "pipeline", 4, ["--configs", "mlp:4:gpipe,mlp:6:1f1b,mlp:8:interleaved", "--bubble", "4"])
    assert [r["config"] for r in result["rows"]] == ["mlp:4:gpipe", "mlp:6:1f1b", "mlp:8:interleaved"]
    for row in result["rows"]:
        assert row["max_loss_diff_vs_torch"] < 1e-6, row
        assert row["max_loss_diff_vs_baseline"] < 1e-4, row
        assert row["ours_s"] > 0 and row["torch_s"] > 0
    assert {b["schedule"] for b in result["bubble"]} == {"gpipe", "1f1b", "interleaved"}
    for b in result["bubble"]:
        assert 0 <= b["measured"] < 1
        assert b["theory"] == pytest.approx(3 / 7 if b["schedule"] != "interleaved" else 3 / 11)


def test_our_zbv_steps_like_torch_zbv_zero_bubble(tmp_path):
    """zbv raced against torch's ScheduleZBVZeroBubble, its stages placed in the same V (rank r holds
    virtual stages r and 2p-1-r, so rank 0 holds the first and the last): the same losses step by step."""
    result = bench(tmp_path, "pipeline", 2, ["--configs", "mlp:4:zbv", "--bubble", ""])
    (row,) = result["rows"]
    assert row["config"] == "mlp:4:zbv" and row["ours_s"] > 0 and row["torch_s"] > 0
    assert row["max_loss_diff_vs_torch"] < 1e-6 and row["max_loss_diff_vs_baseline"] < 1e-4, row


def test_torchs_zbv_opens_no_link_to_its_own_rank():
    """bench.no_link_to_self: torch 2.11's ScheduleZBVZeroBubble opened the V's tip link with a dummy send
    to its own rank, which gloo cannot pair; the race test above runs it only on such a torch."""
    import importlib.util
    import os
    from types import SimpleNamespace
    from helpers import ROOT
    spec = importlib.util.spec_from_file_location("bench", os.path.join(ROOT, "benchmarks", "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ops = [SimpleNamespace(group_peer=peer, peer=peer) for peer in (0, 1, 1, 2)]   # recv, send to both sides
    stage = SimpleNamespace(group_rank=1, _get_init_p2p_neighbors_ops=lambda: ops)
    bench.no_link_to_self(stage)
    assert [op.group_peer for op in stage._get_init_p2p_neighbors_ops()] == [0, 2]


def test_our_tensor_parallel_mlp_steps_like_torch_tensor_parallel(tmp_path):
    result = bench(tmp_path, "tp", 2)
    assert (result["backend"], result["device"]) == ("gloo", "cpu")   # the report says where it ran
    row = result["rows"][0]
    assert row["config"] == "mlp:tp2"
    assert row["max_loss_diff_vs_torch"] < 1e-5 and row["max_loss_diff_vs_baseline"] < 1e-4, row


def test_block_costs_split_minimises_the_slowest_stage():
    import importlib.util
    import itertools
    import os
    from helpers import ROOT
    spec = importlib.util.spec_from_file_location("block_costs", os.path.join(ROOT, "benchmarks", "block_costs.py"))
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    costs = [1.12, 0.87, 0.15, 0.08, 0.03]                        # the cnn's blocks, ms, as measured
    slowest, split = bc.best_split(costs, 4)
    assert sum(split) == 5 and len(split) == 4 and slowest == bc.stage_max(costs, split) == 1.12
    assert bc.stage_max(costs, bc.split_sizes(5, 4)) == pytest.approx(1.99)     # 2,1,1,1 puts both convs together
    for p in (1, 2, 3):                                           # no split of consecutive blocks does better
        every = [s for s in itertools.product(range(1, 6), repeat=p) if sum(s) == 5]
        assert bc.best_split(costs, p)[0] == pytest.approx(min(bc.stage_max(costs, s) for s in every))


@pytest.mark.parametrize("what,flags,world,message", [
    ("pipeline", ["--layers", "6", "--configs", "mlp:8:interleaved"], 4,
     "error: --configs mlp:8:interleaved: 4 stages x 2 virtual stages = 8 chunks but the mlp has only 6 blocks"),
    ("pipeline", ["--layers", "6", "--configs", "mlp:4:1f1b", "--bubble", "4"], 4,   # the bubble table's runs too
     "error: --bubble 4 (mlp, interleaved): 4 stages x 2 virtual stages = 8 chunks but the mlp has only 6 blocks"),
    ("pipeline", ["--configs", "mlp:8"], 4, "error: --configs 'mlp:8': a config is model:microbatches:schedule"),
    ("tp", ["--hidden", "2"], 4, "error: mlp:tp4: the tensor-parallel degree 4 exceeds the 2 --hidden neurons"),
])
def test_a_config_the_program_refuses_is_one_error_line_before_any_engine_runs(what, flags, world, message,
                                                                               monkeypatch, capsys):
    """Each run is checked by the program's own parse_args at the world size, so a config it refuses
    exits 2 with its reason (once an IndexError in the middle of the benchmark)."""
    import os
    import sys
    from helpers import ROOT, assert_one_error_line
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench
    argv = [what, "--out", "x.json", "--batch-size", "24", "--bubble", "", *flags]
    assert_one_error_line(bench.parse_args, argv, world, message, monkeypatch, capsys)


@pytest.mark.slow
def test_our_data_axis_steps_like_ddp_and_fsdp2(tmp_path, monkeypatch, capsys):
    """Issue 66: benchmarks/data_axis.py on tiny sizes, 2 replicas: our --zero 0 and --zero 3 (weights
    gathered for every use) against DistributedDataParallel and FSDP2 with reshard_after_forward, each
    its own torchrun, paired: the same losses step by step (float32 rounding: the engines sum in other
    orders), and a row per pair with a step time and a memory figure each. The driver runs here, its
    torchruns on the tests' zygote ($PYTHON, as the launchers' tests set it), without the floor runs
    (--no-floor): 4 launches, where the benchmark's memory figures take 8."""
    import os
    import sys
    from helpers import PYTHON, ROOT
    monkeypatch.setenv("PYTHON", PYTHON)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import data_axis
    out = tmp_path / "axis.json"
    monkeypatch.setattr(sys, "argv", ["data_axis.py", "--dp", "2", "--layers", "3", "--hidden", "32", "--batch-size",
                                      "16", "--steps", "3", "--rounds", "1", "--out", str(out), "--no-floor",
                                      "--only", f"0,ddp,{data_axis.LIKE},3-microbatch,fsdp2-rs"])
    data_axis.main()
    printed = capsys.readouterr().out
    assert "| ours | torch | peak, MB (2 ranks) ours / torch |" in printed, printed
    weights = ((3072 + 1) * 32 + (32 + 1) * 32 + (32 + 1) * 10) * 4 / 2**20    # N, whatever engines ran
    assert f"N = {weights:.2f} MB of weights" in printed and "with glibc's own allocator, each pair" in printed, printed
    # the machine the step times depend on, in the table's last line and in --out for --table
    group = data_axis.autogroup()
    said = "" if group is None else f", the kernel's autogroup {'on' if group else 'off'}"
    assert f"; {data_axis.usable_cores()} cores{said}." in printed, printed
    memory, usage = printed.split("| ours | torch | CPU ms a step (2 ranks) ours / torch | ratio |")
    pairs = [["| --zero 0", "ddp"], ["| --zero 0", data_axis.LIKE], ["| --zero 3 microbatch", "fsdp2-rs"]]
    for part in (memory, usage):       # a row per pair in each table: memory and time, then where the time goes
        rows = [line for line in part.splitlines() if line.startswith("| --zero")]
        assert [r.split(" | ")[:2] for r in rows] == pairs, rows
    cores = data_axis.usable_cores()      # the main threads' part of it, and the share of their time the ranks
    assert usage.startswith(" of which main threads ours / torch | ratio | page faults"), usage   # left idle
    assert f"ratio | cores idle ({cores}) ours / torch |" in usage, usage
    for row in [line for line in usage.splitlines() if line.startswith("| --zero")]:
        assert re.fullmatch(r"\d+\.\d% / \d+\.\d%", row.split(" | ")[-1].rstrip(" |")), row
    saved = json.loads(out.read_text())
    assert saved["args"]["cores"] == cores and saved["args"]["autogroup"] == group, saved["args"]
    (round_,) = saved["rounds"]
    # the timed runs took turns (benchmarks/lockstep.py): a pair's steps, and the ddp-like one with --zero 0's
    # and ddp's, one engine at a time, each step's turns in order (step 0's after every set-up: --steps 3, then
    # one empty turn); each engine's span their sum
    assert "each pair's engines in lockstep" in printed, printed
    for group in (["0", "ddp", data_axis.LIKE], ["3-microbatch", "fsdp2-rs"]):
        turns = [t for step in zip(*[round_[name]["turns"] for name in group]) for t in step]
        assert len(turns) == 4 * len(group) and all(a[1] <= b[0] for a, b in zip(turns, turns[1:])), (group, turns)
        for name in group:
            assert round_[name]["wall_s"] == pytest.approx(sum(e - b for b, e in round_[name]["turns"])), name
    for ours, theirs in (("0", "ddp"), ("0", data_axis.LIKE), ("3-microbatch", "fsdp2-rs")):
        a, b = round_[ours]["losses"], round_[theirs]["losses"]
        assert len(a) == len(b) == 3 and max(abs(x - y) for x, y in zip(a, b)) < 1e-6, (ours, a, b)
        for side in (round_[ours], round_[theirs]):
            assert side["median_step_time_s"] > 0 and side["above_floor_mb"] > 0, side
            # the steps' CPU time and page faults, from both ranks' files (launch() fails without one); step 0
            # makes the gradients, so new pages are touched
            assert side["cpu_s"] > 0 and side["minor_faults"] > 0, side
            assert 0 < side["main_cpu_s"] <= side["cpu_s"], side    # one thread's share of every thread's
            # the ranks' CPU time fits in their span on these cores: the idle share printed is 0 to 100%
            assert 0 < side["cpu_s"] <= side["wall_s"] * cores, side


def test_data_axis_ratios_give_the_rounds_range(monkeypatch):
    """A ratio cell of benchmarks/data_axis.py's tables is the median of the rounds' ratios ours/torch and, with
    several rounds, their lowest and highest: a median of 1.01 over rounds from 0.97 to 1.05 is the spread."""
    import os
    from helpers import ROOT
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import data_axis
    rounds = [{"ours": 1.05, "torch": 1.0}, {"ours": 0.97, "torch": 1.0}, {"ours": 2.02, "torch": 2.0}]
    speed = lambda r: r["ours"] / r["torch"]   # noqa: E731
    assert data_axis.ratio(rounds, speed) == "1.01 (0.97-1.05)"
    assert data_axis.ratio(rounds[:1], speed) == "1.05"        # one round: its ratio alone


def test_data_axis_like_for_like_ddp_has_our_buckets_cap(tmp_path, monkeypatch):
    """benchmarks/data_axis.py's ddp-like is DDP with our --zero 0 buckets' cap (mp.buckets.kept_bytes), where
    ddp keeps DDP's 25 MB, and is run only when --only names it. Both made here, in a one-rank gloo group."""
    import os
    import torch.distributed as dist
    import torch.nn as nn
    from helpers import ROOT
    from mp.buckets import kept_bytes
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import data_axis
    assert data_axis.LIKE == "ddp-like" and data_axis.LIKE not in data_axis.DEFAULT
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        args = data_axis.parse_args(["--dp", "1", "--optimizer", "adamw", "--data", "synthetic"])
        like, _ = data_axis.wrap(data_axis.LIKE, nn.Linear(4, 4), args, 1)
        plain, _ = data_axis.wrap("ddp", nn.Linear(4, 4), args, 1)
    finally:
        dist.destroy_process_group()
    cap = kept_bytes(list(nn.Linear(4, 4).parameters()))          # the least, 4 MB, for so small a model
    assert like.bucket_bytes_cap == int(cap) == 4 * 2**20 and plain.bucket_bytes_cap == 25 * 2**20


@pytest.mark.parametrize("argv,message", [
    (["--only", "0,fsdp3"], "error: --only fsdp3: no such engine; choose among 0,ddp,ddp-like,1,zero1"),
    (["--rounds", "0"], "error: --rounds 0: at least one round"),
    (["--steps", "1"], "error: --steps 1: at least 2"),
], ids=["engine", "rounds", "steps"])
def test_data_axis_bad_input_is_one_error_line(argv, message, monkeypatch, capsys):
    """benchmarks/data_axis.py's flags that cannot make a table: one line, exit 2, before any torchrun."""
    import os
    import sys
    from helpers import ROOT
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import data_axis
    monkeypatch.setattr(sys, "argv", ["data_axis.py"] + argv)
    with pytest.raises(SystemExit) as stop:
        data_axis.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(message), err


def test_data_axis_rounds_alternate_which_side_runs_first(monkeypatch):
    """benchmarks/data_axis.py's rounds run the engines in ORDER, then in reverse, so that neither side of a
    pair always runs first (the launches are recorded here, nothing is started)."""
    import argparse
    import os
    from helpers import ROOT
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import data_axis
    ran = []

    def launch(name, flags, log, pinned=True):
        ran.append(name)
        return {"median_step_time_s": 1.0, "peak_memory_mb": {"0": 2.0}}

    monkeypatch.setattr(data_axis, "launch", launch)
    def together(names, flags, tmp):
        ran.append(names)
        return {name: {"median_step_time_s": 1.0, "peak_memory_mb": {"0": 2.0}} for name in names}

    monkeypatch.setattr(data_axis, "launch", launch)
    monkeypatch.setattr(data_axis, "together", together)
    args = argparse.Namespace(model="mlp", layers=2, dp=2, batch_size=8, steps=2, hidden=8, no_floor=True,
                              only=["ddp", "0", "fsdp2-rs", "3-microbatch"], apart=True)
    in_order = ["0", "ddp", "3-microbatch", "fsdp2-rs"]         # ORDER's, whatever order --only gave
    for backwards in (False, True):
        ran.clear()
        data_axis.one_round(args, "unused", backwards=backwards)
        assert ran == (in_order[::-1] if backwards else in_order), (backwards, ran)
    args.apart = False                # in lockstep: each pair's timed runs together, who steps first alternating
    for backwards in (False, True):
        ran.clear()
        data_axis.one_round(args, "unused", backwards=backwards)
        pairs = [["0", "ddp"], ["3-microbatch", "fsdp2-rs"]]
        assert ran == ([p[::-1] for p in pairs[::-1]] if backwards else pairs), (backwards, ran)
