"""The committed figures in plots/ are what docs/running.md's one command draws, and the numbers the
README quotes come from them, or say where and when they were measured. Reads the PNGs' text
chunks (mp.tools.figure.save writes the runs' settings and results there); runs nothing."""
import os
import re

import pytest

from mp.tools.figure import png_record
from helpers import ROOT

# each launcher's figures under the names it gives them with the documented knobs (off their defaults)
FIGURES = {"run_pipeline": ["pipeline_loss_synthetic.png", "pipeline_timeline_synthetic.png",
                            "pipeline_loss_2bw_synthetic.png"],
           "run_joint": ["joint_loss_synthetic.png"],
           "run_tp": ["tp_loss_hybrid1_synthetic.png"], "run_3d": ["3d_loss_synthetic.png"],
           "run_cp": ["cp_loss_synthetic.png"], "run_ep": ["ep_loss_synthetic.png"], "run_5d": ["5d_loss_synthetic.png"]}
OTHER_COMMANDS = {"pipeline_memory.png": "bash benchmarks/run.sh",   # drawn by another documented command
                  "tp_ladder.png": "python benchmarks/tp_ladder.py --steps 300 --plot plots/tp_ladder.png",
                  "mesh_5d.png": "python -m mp.tools.mesh -o plots/mesh_5d.png",
                  # the language model's, one launcher each (docs/language_model.md)
                  "cp_loss_gpt_loss-maskprefix_adamw_synthetic.png":
                      "MODEL=gpt DATA=synthetic OPTIMIZER=adamw PLOTS=plots bash run_cp.sh --loss-mask prefix",
                  "pipeline_loss_gpt_1f1b_loss-maskprefix_tie-embeddings_adamw_synthetic.png":
                      "MODEL=gpt DATA=synthetic OPTIMIZER=adamw SCHEDULE=1f1b PLOTS=plots bash run_pipeline.sh "
                      "--loss-mask prefix --tie-embeddings",
                  "5d_loss_gpt_loss-maskprefix_tie-embeddings_adamw_steps60_synthetic_evalevery20.png":
                      "MODEL=gpt DATA=synthetic OPTIMIZER=adamw STEPS=60 EVAL_EVERY=20 PLOTS=plots bash run_5d.sh "
                      "--loss-mask prefix --tie-embeddings"}


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def documented_command():
    """{launcher: its knobs} of the two lines in docs/running.md that rewrite plots/: a loop over
    launchers with the same knobs, then one launcher with its own."""
    lines = read("docs/running.md").splitlines()
    start = lines.index(next(line for line in lines if line.startswith("for run in ")))
    loop = re.fullmatch(r"for run in ([\w ]+); do ((?:\w+=\S+ )+)bash \$run\.sh \|\| break; done", lines[start])
    single = re.fullmatch(r"((?:\w+=\S+ )+)bash (\w+)\.sh", lines[start + 1])
    assert loop and single, lines[start:start + 2]
    knobs = lambda text: dict(pair.split("=", 1) for pair in text.split())
    return {**{run: knobs(loop.group(2)) for run in loop.group(1).split()}, single.group(2): knobs(single.group(1))}


def settings(launcher, knobs=None):
    """The launcher's knobs as that command sets them: its defaults (knob NAME "value"), then the command's."""
    text = read(launcher + ".sh") + read("mp/tools/launch_checks.sh")   # its own knobs, then shared_knobs
    found = dict(re.findall(r'^\s*knob (\w+) "([^"]*)"', text, re.M))
    return {**found, **(documented_command()[launcher] if knobs is None else knobs)}


def test_the_command_rewrites_the_committed_figures_and_nothing_else_does():
    commands = documented_command()
    assert sorted(commands) == sorted(FIGURES) and all(k.get("PLOTS") == "plots" for k in commands.values())
    committed = sorted(f for f in os.listdir(os.path.join(ROOT, "plots")) if f.endswith(".png"))
    assert committed == sorted(sum(FIGURES.values(), []) + list(OTHER_COMMANDS)), committed
    for figure, command in OTHER_COMMANDS.items():
        assert command in read("docs/running.md") and figure in read("docs/running.md")


def loss_record(figure):
    title, record = png_record(os.path.join(ROOT, "plots", figure))
    assert record.get("kind") == "curves", f"plots/{figure} was not drawn by this mp.tools.plot_curves: redraw it"
    return title, record["runs"]


@pytest.mark.parametrize("launcher", sorted(FIGURES))
def test_each_loss_figure_shows_the_runs_of_the_documented_knobs(launcher):
    s = settings(launcher)
    s.setdefault("MODEL", "vit")   # run_cp.sh and run_ep.sh have no MODEL knob: they train the vit
    title, runs = loss_record(FIGURES[launcher][0])
    base, parallel = runs[0], runs[1:]
    data = "SYNTHETIC" if s["DATA"] == "synthetic" else s["DATA"].upper()
    assert f"model {s['MODEL']}, {data}" in title and f"baseline batch {s['BATCH_SIZE']}, {s['STEPS']} steps" in title
    assert f"seed {s['SEED']}" in title, title
    assert base["program"] == "single_baseline"
    for run in runs:
        args = run["args"]
        assert (args["model"], args["data"], args["steps"], args["batch_size"], args["seed"]) == (
            s["MODEL"], s["DATA"], int(s["STEPS"]), int(s["BATCH_SIZE"]), int(s["SEED"])), run["label"]
        assert run["train_steps"] == int(s["STEPS"]), run["label"]                # finished, not cut short
        assert args.get("activation", "gelu") == s["ACTIVATION"], run["label"]  # a log before the flag: gelu
    # a mixture of experts is exact until a near-tie between two experts routes a token the other way
    # (docs/expert_parallel.md): held to the contract up to the first step whose routing differs
    parted = png_record(os.path.join(ROOT, "plots", FIGURES[launcher][0]))[1].get("expert_load", {})
    for run in parallel:
        worst = parted.get("first_differs", {}).get(run["label"], {}).get("largest_difference_before",
                                                                          run["largest_difference"])
        assert run["world_size"] == int(s["NPROC"]) and worst <= 1e-4, run["label"]
        args = run["args"]
        if launcher != "run_tp" and s.get("BALANCE") != "auto":   # auto is logged as the list it chose
            assert (args.get("balance") or "") == s.get("BALANCE", ""), run["label"]
        if launcher == "run_pipeline":
            assert args["microbatches"] == int(s["MICROBATCHES"])
            assert bool(args.get("recompute")) == (s["RECOMPUTE"] == "1")
        if launcher in ("run_joint", "run_3d"):
            assert (args["dp"], args["microbatches"], args["schedule"]) == (
                int(s["DP"]), int(s["MICROBATCHES"]), s["SCHEDULE"])
        if launcher == "run_3d":
            assert args["tp"] == int(s["TP"])
        if launcher in ("run_ep", "run_5d"):
            assert (args["experts"], args["top_k"], args["capacity_factor"] or "") == (
                int(s["EXPERTS"]), int(s["TOP_K"]), s["CAPACITY"] and float(s["CAPACITY"]))
        if launcher == "run_5d":
            assert (args["dp"], args["cp"], args["tp"], args["ep"], args["microbatches"], args["schedule"]) == (
                int(s["DP"]), int(s["CP"]), int(s["TP"]), int(s["EP"]), int(s["MICROBATCHES"]), s["SCHEDULE"])
    if launcher == "run_pipeline":   # 2bw has a figure of its own, against its own reference
        assert [run["args"]["schedule"] for run in parallel] == [x for x in s["SCHEDULE"].split() if x != "2bw"]
    if launcher == "run_tp":
        assert [bool(run["args"].get("hybrid")) for run in parallel] == [False] + [True] * (s["HYBRID"] == "1")
    if launcher == "run_cp":
        assert [run["args"]["attention"] for run in parallel] == s["ATTENTION"].split()


def test_the_timeline_figure_shows_the_documented_schedules():
    s = settings("run_pipeline")
    _, record = png_record(os.path.join(ROOT, "plots", FIGURES["run_pipeline"][1]))
    assert record.get("kind") == "timeline", f"plots/{FIGURES['run_pipeline'][1]} was not drawn by this mp.tools.plot_curves"
    traces = record["traces"]
    assert [t["schedule"] for t in traces] == s["SCHEDULE"].split()
    for t in traces:
        assert (t["stages"], t["microbatches"], t["recompute"]) == (int(s["NPROC"]), int(s["MICROBATCHES"]),
                                                                   s["RECOMPUTE"] == "1")


def test_the_2bw_figure_draws_it_on_its_delay_1_reference_beside_the_synchronous_baseline():
    s = settings("run_pipeline")
    assert "2bw" in s["SCHEDULE"].split()
    _, record = png_record(os.path.join(ROOT, "plots", FIGURES["run_pipeline"][2]))
    (reference, pipedream), (synchronous,) = record["runs"], record["beside"]
    assert reference["program"] == "single_baseline" and reference["args"]["delay"] == 1
    assert pipedream["args"]["schedule"] == "2bw" and pipedream["largest_difference"] <= 1e-4
    assert synchronous["program"] == "single_baseline" and not synchronous["args"].get("delay")
    for run in (reference, pipedream, synchronous):
        assert run["train_steps"] == int(s["STEPS"]) and run["args"]["model"] == s["MODEL"], run["label"]


# ----------------------------------------------------------------------------- the README's numbers

MEASUREMENT = re.compile(r"\d+(?:\.\d+)?e-\d+|\d+(?:\.\d+)?%|\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b"
                         r"|\d+(?:\.\d+)? ?(?:MB|GB|ms|s|minutes)\b")
DATED = re.compile(r"(?:measured|counted)[^|]*?\d{4}-\d\d-\d\d", re.I)   # the claim says where and when


def readme_segments():
    """The README cut where a claim ends: sentences, within table cells; code blocks left out (the
    quick start's comments are kept: they are claims too)."""
    text = read("README.md")
    text = re.sub(r"```.*?```", lambda m: "\n\n".join(re.findall(r"#.*", m.group(0))), text, flags=re.S)
    for paragraph in text.split("\n\n"):
        cells = paragraph.split("|") if paragraph.lstrip().startswith("|") else [paragraph]
        for cell in cells:
            yield from re.split(r"(?<=[.;])\s+(?=[A-Z`(])", " ".join(cell.split()))


def figure_numbers():
    """Every number the committed loss figures carry, as the README writes them."""
    out = set()
    for figure in sum(FIGURES.values(), []):
        _, record = png_record(os.path.join(ROOT, "plots", figure))
        for run in record.get("runs", []):
            if run["largest_difference"] is not None:
                out.add(f"{run['largest_difference']:.1e}".replace("e-0", "e-"))
            if run["final_test_acc"] is not None:
                out.add(f"{run['final_test_acc']:.1%}")
    return out


def test_every_number_the_readme_quotes_is_drawn_by_the_command_or_dated():
    from_figures, undated = figure_numbers() | {"1e-4"}, []           # 1e-4: the contract, not a measurement
    for segment in readme_segments():
        for number in MEASUREMENT.findall(segment):
            if number not in from_figures and not DATED.search(segment):
                undated.append((number, " ".join(segment.split())[:120]))
    assert not undated, f"numbers neither in plots/ nor marked 'measured ... YYYY-MM-DD': {undated}"


def test_the_figures_numbers_the_readme_quotes_are_the_current_ones():
    quoted = set(MEASUREMENT.findall(read("README.md")))
    assert {n for n in figure_numbers() if n.endswith("%")} & quoted     # the test accuracy
    assert any(n in quoted for n in figure_numbers() if "e-" in n)        # a largest difference


def test_the_committed_ladder_figure_draws_the_contract_line():
    """plots/tp_ladder.png came from benchmarks/tp_ladder.py's plot(), which draws the 1e-4 line on
    its difference panel and records it; an older drawing has no "contract" in its record."""
    title, record = png_record(os.path.join(ROOT, "plots", "tp_ladder.png"))
    assert record.get("kind") == "tp_ladder" and record.get("contract") == 1e-4, "redraw: " + OTHER_COMMANDS["tp_ladder.png"]
    assert record["args"]["steps"] == 300 and "relu" in title
    assert record["largest_difference"]["pair"] > record["contract"]    # ReLU crosses it (docs/tensor_parallel.md)


@pytest.mark.parametrize("figure", [f for f in OTHER_COMMANDS if "_gpt_" in f])
def test_each_language_model_figure_draws_the_gpt_against_its_baseline_under_the_contract(figure):
    """The gpt's figures: drawn by this plot_curves, every run of --model gpt with the command's settings
    (the loss mask, AdamW), the parallel runs within the contract at every step (the title says PASS)."""
    title, runs = loss_record(figure)
    knob = re.search(r"STEPS=(\d+)", OTHER_COMMANDS[figure])
    steps = int(knob.group(1)) if knob else 300
    assert title.startswith("PASS: "), title
    assert len(runs) >= 2 and all(r["args"]["model"] == "gpt" and r["args"]["optimizer"] == "adamw" and
                                  r["args"]["loss_mask"] == "prefix" and r["args"]["steps"] == steps
                                  for r in runs), runs
