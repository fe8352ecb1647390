"""Pipeline timelines drawn as Gantt charts, each beside the planned clock table of its schedule
(python -m mp.tools.plot_curves --timeline; the whole picture is in plot_curves' docstring), and one
planned table alone (python -m mp.tools.schedule -o)."""
import json
import textwrap

import matplotlib.lines
import matplotlib.ticker

from mp.pp.schedules import SCHEDULES, bubble_theory, clock_cells
from mp.tools.figure import fail, plt, read_text, save

COLOURS = {"forward": "#4C72B0", "recompute": "#8FB0DD", "backward": "#DD8452", "weight": "#55A868",
           "wait": "#C0C0C0", "collective": "#2F2F2F"}
MEANINGS = {"forward": "forward", "recompute": "forward again (R, --recompute)", "backward": "backward",
            "weight": "weight gradient (W)", "wait": "waiting for a message",
            "collective": "a gradient bucket's all-reduce, beside the work"}   # zb's B: input gradient only
HATCHES = ["", "////", "....", "xxxx"]   # chunk a, b, c, d of an interleaved rank
SPARE = ["#8172B3", "#C44E52", "#937860", "#DA8BC3", "#CCB974"]  # categories a trace adds later


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
