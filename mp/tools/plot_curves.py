"""Draw what the programs logged: loss curves against the baseline, and pipeline timelines.

    python -m mp.tools.plot_curves logs/single_baseline_cnn_b64.jsonl logs/pipeline_cnn_1f1b_p4_m4_b64.jsonl -o loss.png
    python -m mp.tools.plot_curves --timeline logs/timeline_cnn_gpipe_p4_m4_b64.json \
        logs/timeline_cnn_1f1b_p4_m4_b64.json -o timeline.png

(the files `bash run_pipeline.sh` writes at its defaults; `python single_baseline.py` alone writes
logs/single_baseline.jsonl, and every program takes --log-file and --timeline PATH).

Curves: the first log is the baseline. One figure: training loss of every log, the largest
|loss - baseline loss| per window of steps on a log scale with the 1e-4 line of the equivalence
contract (every parallel program logs the baseline's per-step loss within 1e-4), and test accuracy
where logged. Steps are numbered from 0, as in the logs and on the programs' consoles. Runs whose
settings differ (model, data, seed, batch size, lr, momentum, steps, sizes) are not comparable
step by step: each difference is named on stderr and in the title.
Timelines: the Chrome-trace files that `pipeline_microbatch.py --timeline` writes, drawn as Gantt
charts one above the other, each beside the planned clock table of its schedule, stages and
microbatches (mp.pp.schedules.clock_cells, as python -m mp.tools.schedule draws it). Measured: a
row per rank, a colour per event category (forward, recomputed forward, backward, weight gradient,
and any other the trace carries), waits for a message as thin grey bars, an interleaved rank's
chunk b, c, ... hatched, and the action's name (F3, R3, B3, W3, F1b) on each box wide enough to
hold it; the one-step schedules share one time axis, and 2bw (two steps) has its own. The title
gives each schedule's measured and planned bubble and why they differ (more ranks than CPU cores:
a rank waiting for a core is idle on the trace, not in the plan); a chart's own title names stages
whose compute differs by 1.25x or more. Every PNG is written whole or not at all (a temporary
name, then a rename; Ctrl-C exits 130 with one line) and records its title and
the settings and results it drew in its text chunks (png_record reads them).
"""
import argparse
import json
import os
import sys
import tempfile
import textwrap

import matplotlib
import matplotlib.lines
import matplotlib.ticker

matplotlib.use("Agg")  # no screen on the machines that draw these
import matplotlib.pyplot as plt  # noqa: E402

from mp.pp.schedules import SCHEDULES, bubble_theory, clock_cells  # noqa: E402

TOLERANCE = 1e-4  # the equivalence contract: |loss - baseline loss| <= 1e-4 at every step
COLOURS = {"forward": "#4C72B0", "recompute": "#8FB0DD", "backward": "#DD8452", "weight": "#55A868",
           "wait": "#C0C0C0", "collective": "#2F2F2F"}
MEANINGS = {"forward": "forward", "recompute": "forward again (R, --recompute)", "backward": "backward",
            "weight": "weight gradient (W)", "wait": "waiting for a message",
            "collective": "a gradient bucket's all-reduce, beside the work"}   # zb's B: input gradient only
HATCHES = ["", "////", "....", "xxxx"]   # chunk a, b, c, d of an interleaved rank
SPARE = ["#8172B3", "#C44E52", "#937860", "#DA8BC3", "#CCB974"]  # categories a trace adds later
# the settings two runs must share for their losses to be compared step by step
SAME = ("model", "activation", "data", "seed", "batch_size", "lr", "momentum", "steps", "dropout", "clip_grad_norm",
        "optimizer", "weight_decay", "beta1", "beta2", "adam_eps")
# a log written before these flags existed ran without them (and with gelu, SGD without decay)
OFF = {"dropout": 0.0, "clip_grad_norm": None, "activation": "gelu", "optimizer": "sgd", "weight_decay": 0.0,
       "beta1": 0.9, "beta2": 0.999, "adam_eps": 1e-8}
SIZES = {"mlp": ("layers", "hidden"), "vit": ("layers", "hidden", "heads"), "cnn": ()}


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_text(path, what):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        fail(f"cannot read {what} {path}: {e}")


def read_json_lines(path):
    text = read_text(path, "metrics log")
    try:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        try:
            records = [json.loads(text)]          # one JSON document over several lines: a trace?
        except json.JSONDecodeError:
            fail(f"cannot read metrics log {path}: {e}")
    if records and isinstance(records[0], dict) and "traceEvents" in records[0]:
        fail(f"{path} is a pipeline timeline (a Chrome trace), not a metrics log; draw it with "
             f"--timeline: python -m mp.tools.plot_curves --timeline {path} -o timeline.png")
    if not all(isinstance(r, dict) and "event" in r for r in records):
        fail(f"{path} is not a metrics log (JSON lines with an \"event\" key, as the programs' --log-file writes)")
    return records


def config_of(records):
    return next((r for r in records if r["event"] == "config"), None)


def label_of(records, path):
    """A short name for a run: program plus the settings that tell runs of it apart, its own batch too."""
    config = config_of(records)
    if config is None:
        return os.path.basename(path)
    args, parts = config["args"], []
    for key in ("schedule", "dp", "tp", "microbatches"):
        if args.get(key) is not None:
            parts.append(f"{'m' if key == 'microbatches' else key}={args[key]}" if key != "schedule"
                         else str(args[key]))
    if (args.get("virtual_stages") or 1) > 1:
        parts.append(f"v={args['virtual_stages']}")
    parts += [flag for flag in ("recompute", "hybrid") if args.get(flag)]   # what changes how the run computes
    if args.get("zero"):
        parts.append(f"ZeRO-{args['zero']}")
    if args.get("delay"):
        parts.append(f"--delay {args['delay']}: 2BW's rule")
    if args.get("balance"):
        parts.append(f"balance {args['balance']}")
    if config["world_size"] > 1:
        parts.append(f"{config['world_size']} ranks")
    parts.append(f"batch {args.get('batch_size', '?')}")
    if not any(r["event"] == "summary" for r in records):   # the run stopped before its end
        steps = sum(r["event"] == "train" for r in records)
        print(f"warning: {path} has no summary record: the run stopped after {steps} steps", file=sys.stderr)
        parts.append(f"INCOMPLETE: {steps} of {args.get('steps', '?')} steps")
    return config["program"] + f" ({', '.join(parts)})"


def setting_differences(runs):
    """['batch_size 32 (baseline) vs 64 (label)', ...]: the settings in which a run differs from the baseline."""
    base = (config_of(runs[0][1]) or {}).get("args", {})
    keys = SAME + SIZES.get(base.get("model"), ())
    out = []
    for label, records in runs[1:]:
        args = (config_of(records) or {}).get("args", {})
        out += [f"{k} {base.get(k, OFF.get(k))} (baseline) vs {args.get(k, OFF.get(k))} ({label})" for k in keys
                if args.get(k, OFF.get(k)) != base.get(k, OFF.get(k))]
    return out


def series(records, event, key):
    rows = [r for r in records if r["event"] == event]
    return [r["step"] for r in rows], [r[key] for r in rows]


def differences(base, records):
    """(steps, |loss - baseline loss|) over the steps both runs logged."""
    base_loss = dict(zip(*series(base, "train", "loss")))
    return [(s, abs(loss - base_loss[s])) for s, loss in zip(*series(records, "train", "loss")) if s in base_loss]


def largest_differences(runs):
    """{label: max |loss - baseline loss|} over the steps both logged, for every run but the baseline."""
    return {label: max((d for _, d in differences(runs[0][1], records)), default=float("nan"))
            for label, records in runs[1:]}


def window_maxima(pairs, windows=40):
    """The largest difference in each window of consecutive steps: (last step of the window, max)."""
    size = max(1, -(-len(pairs) // windows))
    return [(chunk[-1][0], max(d for _, d in chunk)) for chunk in
            (pairs[i:i + size] for i in range(0, len(pairs), size))], size


def title_of(runs, mismatches):
    args = (config_of(runs[0][1]) or {}).get("args", {})
    data = args.get("data", "?")
    data = "SYNTHETIC data (not CIFAR-10)" if data == "synthetic" else str(data).upper()
    activation = args.get("activation", OFF["activation"])
    model = args.get("model", "?") + ("" if activation == OFF["activation"] else f" ({activation})")
    title = (f"model {model}, {data}; baseline batch {args.get('batch_size', '?')}, "
             f"{args.get('steps', '?')} steps, {args.get('optimizer', 'sgd')} lr {args.get('lr', '?')}, "
             f"seed {args.get('seed', '?')}")
    if args.get("dropout") or args.get("clip_grad_norm"):
        title += f", dropout {args.get('dropout') or 0}, clip {args.get('clip_grad_norm') or 'off'}"
    diffs = largest_differences(runs)
    if mismatches:
        title += "\nNOT COMPARABLE, the settings differ: " + "; ".join(mismatches[:3]) + (
            f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")
    elif diffs:
        title += f"\nlargest |loss - baseline| = {max(diffs.values()):.2e} (contract: {TOLERANCE:g})"
    return title


def plot_curves(paths, out, beside=()):
    """beside: logs drawn next to the others (dotted) but not held to the contract: the synchronous
    baseline beside 2bw and its --delay 1 reference, where the gap is what staleness costs."""
    runs = [(label_of(recs, p), recs) for p, recs in ((p, read_json_lines(p)) for p in paths)]
    others = [(label_of(recs, p), recs) for p, recs in ((p, read_json_lines(p)) for p in beside)]
    if not series(runs[0][1], "train", "loss")[0]:
        fail(f"{paths[0]} has no training steps; was the run finished?")
    mismatches = setting_differences(runs)
    for m in mismatches:
        print(f"warning: not comparable step by step: {m}", file=sys.stderr)
    panels = ["loss"] + (["diff"] if len(runs) > 1 else [])
    panels += ["acc"] if any(series(recs, "eval", "test_acc")[0] for _, recs in runs) else []
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    ax = dict(zip(panels, axes[0]))
    for i, (label, records) in enumerate(runs):
        # the baseline wide and pale underneath, so curves that match it sit visibly on top
        style = {"lw": 3, "color": "black", "alpha": 0.3} if i == 0 else {"lw": 1.2, "ls": "--"}
        ax["loss"].plot(*series(records, "train", "loss"), label=label + (" [baseline]" if i == 0 else ""), **style)
        if "acc" in ax:
            ax["acc"].plot(*series(records, "eval", "test_acc"), marker="o", label=label, **style)
        if i > 0:
            draw_differences(ax["diff"], differences(runs[0][1], records), label)
    for label, records in others:
        shown = label + " [beside: not compared]"
        ax["loss"].plot(*series(records, "train", "loss"), label=shown, lw=1.2, ls=":", color="tab:grey")
        if "acc" in ax:
            ax["acc"].plot(*series(records, "eval", "test_acc"), marker="x", ls=":", color="tab:grey", label=shown)
        gap = max((d for _, d in differences(runs[0][1], records)), default=float("nan"))
        print(f"drawn beside, not compared: {label}: largest |loss - {runs[0][0]}| {gap:.3g}")
    ax["loss"].set(xlabel="step (from 0)", ylabel="training loss", title="training loss")
    if "acc" in ax:
        ax["acc"].axhline(0.1, color="grey", lw=1, ls=":", label="chance")
        ax["acc"].set(xlabel="step (from 0)", ylabel="test accuracy", title="test accuracy", ylim=(0, 1),
                      xlim=ax["loss"].get_xlim())     # one evaluation is a point on the run's step axis
    for a in ax.values():
        a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))   # whole steps: no step 2.5
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title_of(runs, mismatches), color="red" if mismatches else "black")
    diffs = largest_differences(runs)
    save(fig, out, {"kind": "curves", "runs": [run_summary(label, records, diffs.get(label))
                                               for label, records in runs],
                    "beside": [run_summary(label, records, None) for label, records in others]})
    return diffs


def run_summary(label, records, difference):
    """What the figure's PNG records about one run (tests/test_figures.py reads it back)."""
    config = config_of(records) or {}
    evals = [r for r in records if r["event"] == "eval"]
    return {"label": label, "program": config.get("program"), "world_size": config.get("world_size"),
            "args": config.get("args", {}), "train_steps": sum(r["event"] == "train" for r in records),
            "final_loss": next((r["loss"] for r in reversed(records) if r["event"] == "train"), None),
            "final_test_acc": evals[-1]["test_acc"] if evals else None, "largest_difference": difference}


def draw_differences(ax, pairs, label, floor=1e-12):
    """The largest |loss - baseline| per window of steps, as a line on a log scale (exact: the floor)."""
    if not pairs:
        return
    maxima, size = window_maxima(pairs)
    steps, worst = zip(*maxima)
    ax.semilogy(steps, [max(d, floor) for d in worst], marker=".", lw=1.2, label=label)
    ax.axhline(TOLERANCE, color="red", lw=1, ls=":")
    ax.set(xlabel="step (from 0)", ylim=(floor / 3, 1),
           ylabel="|loss - baseline loss|" + (f", largest per {size} steps" if size > 1 else ""),
           title=f"difference from the baseline\n(red: contract {TOLERANCE:g}; exact 0 drawn at {floor:g})")


def read_trace(path):
    """A Chrome trace as --timeline writes it; a metrics log given by mistake is named as one."""
    text = read_text(path, "timeline")
    try:
        trace = json.loads(text)
    except json.JSONDecodeError as e:
        first = text.lstrip().split("\n", 1)[0]
        if first.startswith("{") and '"event"' in first:
            fail(f"{path} is a metrics log, not a timeline; draw it without --timeline: "
                 f"python -m mp.tools.plot_curves BASELINE_LOG {path} -o loss.png")
        fail(f"cannot read timeline {path}: {e}")
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        fail(f"{path} is not a pipeline timeline (a Chrome trace with \"traceEvents\", as --timeline writes)")
    return trace


def plot_timelines(paths, out):
    """Each measured timeline (left, ms) beside the planned clock table of the same schedule, stages
    and microbatches (right, ticks: mp.pp.schedules.clock_cells); the title says why they differ."""
    traces = [read_trace(path) for path in paths]
    for trace, path in zip(traces, paths):
        if not any(e.get("ph") == "X" for e in trace["traceEvents"]):
            fail(f"the timeline {path} has no events")
    fig = plt.figure(figsize=(20, 1.6 + 3.4 * len(paths)))
    grid = fig.add_gridspec(len(paths), 2, width_ratios=(3, 2))
    measured = [fig.add_subplot(grid[i, 0], label=f"measured {i}") for i in range(len(paths))]
    planned = [fig.add_subplot(grid[i, 1], label=f"planned {i}") for i in range(len(paths))]
    present = {e.get("cat", "wait") for t in traces for e in t["traceEvents"] if e.get("ph") == "X"} - {"step"}
    added = sorted(present - set(COLOURS))                  # e.g. a later schedule's weight-gradient pass
    colours = {**dict(zip(added, SPARE)), **COLOURS}
    for group in time_axes(traces):   # one time axis per group: a slower schedule is a longer row of boxes
        longest = max(span_ms(traces[i]) for i in group)
        for i in group:
            draw_gantt(measured[i], traces[i], colours, points_across(fig, measured[i]) / longest)
            measured[i].set_xlim(-0.02 * longest, 1.02 * longest)
            measured[i].set_xlabel(time_label(traces[i], len(group) > 1), fontsize=8)
    plans = [draw_plan(ax, trace["otherData"] if "otherData" in trace else {}, fig) for ax, trace in zip(planned, traces)]
    handles, labels = timeline_legend(traces, [c for c in COLOURS if c in present] + added, colours)
    planned[0].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(why_measured_exceeds_plan([t.get("otherData", {}) for t in traces]), fontsize=10)
    save(fig, out, {"kind": "timeline", "traces": [
        dict(t.get("otherData", {}), title=ax.get_title(), planned=plan) for t, ax, plan in zip(traces, measured, plans)]})


def time_axes(traces):
    """Groups of traces drawn on one time axis: every one-step schedule together, and a trace of
    several steps (2bw records two) on its own, so its longer span does not squeeze the others."""
    one_step = [i for i, t in enumerate(traces) if t.get("otherData", {}).get("steps", 1) == 1]
    return [g for g in [one_step] + [[i] for i in range(len(traces)) if i not in one_step] if g]


def time_label(trace, shared):
    steps = trace.get("otherData", {}).get("steps", 1)
    what = "the recorded step's" if steps == 1 else f"the {steps} recorded steps'"
    return f"measured: ms from {what} start" + (", one axis for the one-step charts" if shared else ", its own axis")


def points_across(fig, ax):
    """The axis's width in points, about 90% of its share of the figure (tight_layout takes the rest)."""
    return 0.9 * ax.get_position().width * fig.get_figwidth() * 72


def timeline_legend(traces, categories, colours):
    """(handles, labels) of the colours, hatches, step marks and blanks every chart uses."""
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours.get(c, "#999999")) for c in categories]
    labels = [MEANINGS.get(c, c) for c in categories]
    chunks = max(t.get("otherData", {}).get("virtual_stages", 1) for t in traces)
    for c in range(1, min(chunks, len(HATCHES))):         # interleaved: which chunk a box belongs to
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#888888", edgecolor="white", hatch=HATCHES[c]))
        labels.append(f"hatched {HATCHES[c]}: chunk {chr(ord('a') + c)} (plain: chunk a)")
    if any(t.get("otherData", {}).get("steps", 1) > 1 for t in traces):
        handles.append(matplotlib.lines.Line2D([], [], color="black", lw=1.5))
        labels.append("a step begins on that rank\n(2bw: no flush before it)")
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", lw=0.5))
    labels.append("blank, measured: not timed (Python\nbetween actions, optimizer step, or\na rank waiting "
                  "for a free core);\nplanned: idle, the bubble")
    return handles, labels


def span_ms(trace):
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    return (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1000


def draw_gantt(ax, trace, colours, points_per_ms):
    """One chart: a row per rank; a wait is a thin grey bar, so the work stands out; an action's
    name is written on its box where it fits at 7 points, and a chunk other than a is hatched."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    other = trace.get("otherData", {})
    marks, events = [e for e in events if e.get("cat") == "step"], [e for e in events if e.get("cat") != "step"]
    interleaved = other.get("virtual_stages", 1) > 1
    start = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    for e in events:
        kind = e.get("cat", "wait")
        left, width = (e["ts"] - start) / 1000, e["dur"] / 1000
        if kind in ("wait", "collective"):   # thin: a wait on the row, a collective just under it (overlap)
            ax.barh(e["pid"] + (0.45 if kind == "collective" else 0), width, left=left, height=0.25 if kind == "wait"
                    else 0.12, color=colours[kind], linewidth=0)
            continue
        chunk = e.get("args", {}).get("chunk") or 0
        ax.barh(e["pid"], width, left=left, height=0.8, color=colours.get(kind, "#999999"), edgecolor="white",
                linewidth=0.5, hatch=HATCHES[chunk % len(HATCHES)] if interleaved else None)
        name = e.get("name", "") + (chr(ord("a") + chunk) if interleaved else "")  # F3 or B1b as in the tables
        if width * points_per_ms > 4.6 * len(name) + 3:  # about 4.2 points a character at fontsize 7
            ax.text(left + width / 2, e["pid"], name, ha="center", va="center", fontsize=7, color="white",
                    bbox={"facecolor": colours.get(kind, "#999999"), "edgecolor": "none", "pad": 0.5}
                    if interleaved else None)
    for e in marks if other.get("steps", 1) > 1 else []:   # several steps recorded: where each begins
        ax.plot([(e["ts"] - start) / 1000] * 2, [e["pid"] - 0.45, e["pid"] + 0.45], color="black", lw=1.5)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()  # stage 0 on top, as pipelines are drawn in papers
    ax.tick_params(labelbottom=True)
    ax.set_title(gantt_title(other, busy_ms(events)), fontsize=10)


def busy_ms(events):
    """{rank: milliseconds of forward, backward and W work in the step}, each action counted at its
    rank's median time for that kind of action: one action stretched by a wait for a free core
    (ranks > cores) does not make its rank look slow."""
    times = {}
    for e in events:
        if e.get("cat", "wait") not in ("wait", "collective"):
            times.setdefault((e["pid"], e["cat"]), []).append(e["dur"] / 1000)
    busy = {}
    for (rank, _), durations in times.items():
        busy[rank] = busy.get(rank, 0) + len(durations) * sorted(durations)[len(durations) // 2]
    return busy


IMBALANCE = 1.25   # the busiest rank works this many times the least busy one's time or more: say so


def gantt_title(other, busy=None):
    chunks = f", v={other['virtual_stages']}" if other.get("virtual_stages", 1) > 1 else ""
    recompute = ", --recompute" if other.get("recompute") else ""
    title = (f"{other.get('schedule', '?')}{recompute}: {other.get('stages', '?')} stages, "
             f"{other.get('microbatches', '?')} microbatches{chunks}; bubble measured "
             f"{other.get('bubble_measured', float('nan')):.1%}, theory {other.get('bubble_theory', float('nan')):.1%}")
    if busy and min(busy.values()) > 0 and max(busy.values()) >= IMBALANCE * min(busy.values()):
        slow, fast = max(busy, key=busy.get), min(busy, key=busy.get)
        steps = other.get("steps", 1)
        per = "a step" if steps == 1 else f"in {steps} steps"
        title += (f"\nstages unequal: rank {slow} computes {busy[slow]:.1f} ms {per}, rank {fast} {busy[fast]:.1f} ms "
                  f"({busy[slow] / busy[fast]:.1f}x); the others wait for the slowest (--balance moves blocks)")
    return title


def planned_cells(other):
    """The clock table of a trace's schedule, stages, microbatches and chunks; None where the trace
    does not record them, or records a split the programs refuse (2bw with m < p, interleaved with
    m not a multiple of p)."""
    s, p, m = other.get("schedule"), other.get("stages") or 0, other.get("microbatches") or 0
    v = other.get("virtual_stages", 1) if s == "interleaved" else 1
    if s not in SCHEDULES or p < 1 or m < 1 or (s == "2bw" and m < p) or (s == "interleaved" and (p < 2 or m % p)):
        return None
    return clock_cells(s, p, m, v)


def idle_share(rows):
    """The planned bubble: the share of the table's (stage, tick) cells that are idle."""
    ticks = max(len(row) for row in rows)
    return sum(row.count(".") + ticks - len(row) for row in rows) / (len(rows) * ticks)


def plan_title(schedule, p, m, v):
    """The heading of a planned table: the sizes, the ticks and the bubble of the formula (its idle share)."""
    rows = clock_cells(schedule, p, m, v)
    ticks, idle = max(len(row) for row in rows), idle_share(rows)
    chunks = f", v={v} chunks per rank (a tick is 1/{v} of a stage's F or B)" if v > 1 else ""
    if schedule == "2bw":
        chunks = " per step, two steps drawn (the second's microbatches numbered from m; no flush between)"
    steps = 2 if schedule == "2bw" else None
    return (f"{schedule}: {p} stages, {m} microbatches{chunks}; {ticks} ticks, "
            f"idle {idle:.1%} of the table = bubble_theory {bubble_theory(p, m, v, schedule, steps):.1%}")


def draw_plan(ax, other, fig):
    """The planned chart beside a measured one; returns what it drew ({"ticks", "idle"}, or None)."""
    rows = planned_cells(other)
    if rows is None:
        ax.set_axis_off()
        ax.set_title("no plan: the trace does not record a schedule mp.pp.schedules can draw", fontsize=9)
        return None
    ticks, idle = max(len(row) for row in rows), idle_share(rows)
    draw_clock_table(ax, rows, points_across(fig, ax) / ticks)
    title = f"planned {other['schedule']} (mp.pp.schedules): {ticks} ticks, idle {idle:.1%}"
    if other["schedule"] == "2bw":
        title += "\nits first two steps, with fill and drain;\nthe measured steps are steady ones: planned 0%"
    else:
        v = other.get("virtual_stages", 1) if other["schedule"] == "interleaved" else 1
        title += "\nevery F, B and W one tick" + (f" (1/{v} of a stage)" if v > 1 else "") + ", messages free"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("planned: clock tick (white: idle, the bubble)", fontsize=8)
    return {"ticks": ticks, "idle": idle}


def why_measured_exceeds_plan(others):
    """The timeline figure's title: each schedule's measured and planned bubble, and why they differ."""
    numbers = "; ".join(f"{o.get('schedule', '?')} {o.get('bubble_measured', float('nan')):.0%} measured "
                        f"against {o.get('bubble_theory', float('nan')):.0%} planned"
                        + (" (steady steps)" if o.get("schedule") == "2bw" else "") for o in others)
    ranks = max(o.get("stages", 0) for o in others)
    cores = min((o["cpu_cores"] for o in others if o.get("cpu_cores")), default=0)
    if all(o.get("device", "cpu") == "cpu" for o in others) and 0 < cores < ranks:
        why = (f"Why measured > planned: the {ranks} ranks shared {cores} CPU cores, so at most {cores} computed at "
               f"once; a rank whose message had arrived still waited for a free core, and the trace counts that "
               f"wait as idle. The plan gives every stage a processor of its own; with a core or GPU per rank the "
               f"gap shrinks to what unequal stages and messages add.")
    else:
        why = ("Why measured > planned: the plan counts every F, B and W as one equal tick and messages as free; "
               "measured, stages differ in cost, and messages and Python between actions take time.")
    return "\n".join(textwrap.wrap(f"Measured timelines (left) beside the planned schedules (right). Bubble: {numbers}.", 170)
                     + textwrap.wrap(why, 170))


def draw_clock_table(ax, rows, points_per_tick=None):
    """schedules.clock_cells() drawn on ax: a row per stage, a box per tick, coloured as the measured
    timelines (F forward, B backward, W weight gradient), chunk b, c, ... hatched; white: idle. A
    box's name is written where it fits at points_per_tick (None: always)."""
    kinds = {"F": "forward", "B": "backward", "W": "weight"}
    for stage, row in enumerate(rows):
        for tick, cell in enumerate(row):
            if cell == ".":
                continue
            chunk = ord(cell[-1]) - ord("a") if cell[-1].isalpha() else 0
            colour = COLOURS[kinds[cell[0]]]
            ax.barh(stage, 1, left=tick, height=0.8, color=colour, edgecolor="white", linewidth=0.8,
                    hatch=HATCHES[chunk % len(HATCHES)] or None)
            size = 7 if len(cell) < 4 else 6
            if points_per_tick is None or points_per_tick > 0.65 * size * len(cell) + 2:
                ax.text(tick + 0.5, stage, cell, ha="center", va="center", fontsize=size, color="white",
                        bbox={"facecolor": colour, "edgecolor": "none", "pad": 0.3} if chunk else None)
    ax.set_yticks(range(len(rows)), [f"stage {r}" for r in range(len(rows))])
    ax.set_xlim(0, max(len(row) for row in rows))
    ax.set_ylim(len(rows) - 0.5, -0.5)     # stage 0 on top
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))


def plot_clock_table(rows, title, out):
    """One planned table in a PNG of its own (python -m mp.tools.schedule -o)."""
    kinds = {"F": "forward", "B": "backward", "W": "weight"}
    ticks = max(len(row) for row in rows)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * ticks + 2), 1.4 + 0.5 * len(rows)))
    draw_clock_table(ax, rows)
    ax.set_xlabel("clock tick (every F, B and W one tick; white: idle, the bubble)")
    ax.set_title(title.replace("; ", "\n", 1), fontsize=9)
    present = sorted({cell[0] for row in rows for cell in row if cell != "."}, key="FBW".index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[kinds[k]]) for k in present]
    labels = [f"{k}: {MEANINGS[kinds[k]]}" for k in present]
    if any(cell[-1] == "b" for row in rows for cell in row):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="#888888", edgecolor="white", hatch=HATCHES[1]))
        labels.append("hatched: chunk b, c, ... (plain: a)")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    save(fig, out, {"kind": "clock table", "title": title})


def save(fig, out, record=None):
    """The PNG, with the figure's title and `record` (the settings and numbers drawn, as JSON) in
    its text chunks, so a test can check a committed figure against the command said to make it.
    Written under a temporary name in the same folder, then renamed: a figure is whole or absent
    under its name, even when the drawing is interrupted (Ctrl-C) or fails."""
    folder = os.path.dirname(out) or "."
    os.makedirs(folder, exist_ok=True)
    fig.tight_layout()
    title = fig._suptitle.get_text() if fig._suptitle else " / ".join(a.get_title() for a in fig.axes if a.get_title())
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(out)}.", suffix=".partial")
    os.close(fd)
    try:
        fig.savefig(partial, format="png", dpi=110, metadata={
            "Title": title, "Description": json.dumps(record or {}), "Software": "mp.tools.plot_curves"})
        os.replace(partial, out)          # atomic on one file system: readers see the old PNG or the new
    finally:
        plt.close(fig)
        if os.path.exists(partial):       # interrupted or failed: leave no half-written file behind
            os.remove(partial)
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="metrics logs (first = baseline), or traces with --timeline")
    p.add_argument("-o", "--out", required=True, help="PNG to write")
    p.add_argument("--timeline", action="store_true", help="the files are pipeline timelines")
    p.add_argument("--beside", nargs="+", default=[], metavar="LOG",
                   help="logs drawn next to the curves but not compared with the first (e.g. the synchronous "
                        "baseline beside 2bw and its single_baseline.py --delay 1 reference)")
    args = p.parse_args(argv)
    for path in args.files + args.beside:
        if not os.path.exists(path):
            fail(f"{path} does not exist; run the program that writes it first")
    try:
        if args.timeline:
            plot_timelines(args.files, args.out)
            return
        for label, diff in plot_curves(args.files, args.out, args.beside).items():
            print(f"largest |loss - baseline| for {label}: {diff:.3g}")
    except KeyboardInterrupt:   # Ctrl-C: one line, no traceback; save() has removed its partial file
        print(f"interrupted: {args.out} not written", file=sys.stderr)
        sys.exit(130)


def png_record(path):
    """(title, record) that save() wrote into a PNG's text chunks; ("", {}) for a PNG without them."""
    from PIL import Image              # matplotlib's own dependency
    with Image.open(path) as image:
        text = dict(image.text) if hasattr(image, "text") else {}
    return text.get("Title", ""), json.loads(text.get("Description") or "{}")


if __name__ == "__main__":
    main()
