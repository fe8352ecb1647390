"""Draw what the programs logged: loss curves against the baseline, and pipeline timelines.

    python -m mp.tools.plot_curves logs/single_baseline_cnn_b64.jsonl logs/pipeline_cnn_1f1b_p4_m4_b64.jsonl -o loss.png
    python -m mp.tools.plot_curves --timeline logs/timeline_cnn_gpipe_p4_m4_b64.json \
        logs/timeline_cnn_1f1b_p4_m4_b64.json -o timeline.png

(the files `bash run_pipeline.sh` writes at its defaults; `python single_baseline.py` alone writes
logs/single_baseline.jsonl, and every program takes --log-file and --timeline PATH).

Curves: the first log is the baseline. One figure: training loss of every log, the largest
|loss - baseline loss| per window of steps on a log scale with the 1e-4 line of the equivalence
contract (every parallel program logs the baseline's per-step loss within 1e-4; a window of exact
zeros is a gap), test accuracy where logged, and a mixture of experts' load per expert (then the four
panels are two rows of two). The contract is judged (mp.tools.contract): where a run's routing is
the baseline's, or there is none, every step within 1e-4; the title and one printed line a run say
what holds (exact to X until the routing first differs at step S, marked on the difference panel),
and a run that breaks it is drawn, then named with the step on stderr, exit status 1. Each parallel run has a colour and marker of its own in every panel, and the runs take
turns along one dash pattern, so runs that lie on one another (every run within the contract is
within a pixel of the baseline) all show; a run whose per-step losses repeat an earlier run's bit for
bit says so in the legend ("identical to <run>", "= baseline"), as GPipe's and 1F1B's do. Fewer than
4 evaluations are drawn as points, not a line, with a note (heading the panel's legend) saying they
show no trend and why test accuracy may fall while the test loss falls. Every legend sits below its
panel, outside the data, so none covers a curve or the note. Steps are numbered from 0, as in the logs and on the
programs' consoles. Runs whose settings differ (model, data, seed, batch size, lr, momentum, steps,
sizes) are not comparable step by step: each difference is named on stderr and in the title.
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
the settings and results it drew in its text chunks (mp.tools.figure.png_record reads them).
"""
from mp.errors import say_when_interrupted, stop_on_interrupt
if __name__ == "__main__":   # Ctrl-C while matplotlib is imported: one line, exit 130 (main handles it after)
    say_when_interrupted(lambda: "interrupted while starting: no figure written")
    stop_on_interrupt()

import argparse
import json
import os
import signal
import sys
import textwrap

import matplotlib.ticker

from mp.tools.contract import (BAND, LIMIT, TOLERANCE, WINDOW, breach_line, differences, headline, judge,
                               running_differences, sentence, series)
from mp.tools.expert_panel import draw_expert_load, expert_loads
from mp.tools.figure import fail, plt, read_text, save
from mp.tools.plot_timeline import plot_timelines
# the settings two runs must share for their losses to be compared step by step
SAME = ("model", "activation", "data", "seed", "batch_size", "lr", "momentum", "steps", "dropout", "clip_grad_norm",
        "optimizer", "weight_decay", "beta1", "beta2", "adam_eps", "experts", "top_k", "capacity_factor", "aux_loss")
# a log written before these flags existed ran without them (and with gelu, SGD without decay, dense)
OFF = {"dropout": 0.0, "clip_grad_norm": None, "activation": "gelu", "optimizer": "sgd", "weight_decay": 0.0,
       "beta1": 0.9, "beta2": 0.999, "adam_eps": 1e-8, "experts": 0, "top_k": 1, "capacity_factor": None,
       "aux_loss": 0.01}
SIZES = {"mlp": ("layers", "hidden"), "vit": ("layers", "hidden", "heads"), "cnn": ()}


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
    for key in ("schedule", "attention", "dp", "cp", "tp", "ep", "microbatches"):   # cp, ep: parallel_5d.py's
        if args.get(key) is not None:
            parts.append(f"{'m' if key == 'microbatches' else key}={args[key]}" if key != "schedule"
                         else str(args[key]))
    if (args.get("virtual_stages") or 1) > 1:
        parts.append(f"v={args['virtual_stages']}")
    parts += [flag for flag in ("recompute", "hybrid", "sequence_parallel") if args.get(flag)]   # how the run computes
    if args.get("experts"):
        parts.append(f"E={args['experts']} top-{args.get('top_k', 1)}" + (
            f" C={args['capacity_factor']:g}" if args.get("capacity_factor") else " dropless"))
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


def largest_differences(runs):
    """{label: max |loss - baseline loss|} over the steps both logged, for every run but the baseline."""
    return {label: max((d for _, d in differences(runs[0][1], records)), default=float("nan"))
            for label, records in runs[1:]}


def window_maxima(pairs, windows=40):
    """The largest difference in each window of consecutive steps: (last step of the window, max)."""
    size = max(1, -(-len(pairs) // windows))
    return [(chunk[-1][0], max(d for _, d in chunk)) for chunk in
            (pairs[i:i + size] for i in range(0, len(pairs), size))], size


def title_of(runs, mismatches, verdicts=None):
    args = (config_of(runs[0][1]) or {}).get("args", {})
    data = args.get("data", "?")
    real = "tiny Shakespeare" if args.get("model") == "gpt" else "CIFAR-10"
    data = f"SYNTHETIC data (not {real})" if data == "synthetic" else str(data).upper()
    activation = args.get("activation", OFF["activation"])
    model = args.get("model", "?") + ("" if activation == OFF["activation"] else f" ({activation})")
    title = (f"model {model}, {data}; baseline batch {args.get('batch_size', '?')}, "
             f"{args.get('steps', '?')} steps, {args.get('optimizer', 'sgd')} lr {args.get('lr', '?')}, "
             f"seed {args.get('seed', '?')}")
    if args.get("dropout") or args.get("clip_grad_norm"):
        title += f", dropout {args.get('dropout') or 0}, clip {args.get('clip_grad_norm') or 'off'}"
    if mismatches:
        title += "\nNOT COMPARABLE, the settings differ: " + "; ".join(mismatches[:3]) + (
            f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")
    elif len(runs) > 1:   # the verdict first: what a grader reads in ten seconds
        verdict = headline(verdicts_of(runs, mismatches) if verdicts is None else verdicts)
        title = f"{verdict}\n{title}" if verdict else title
    return title


def verdicts_of(runs, mismatches):
    """The contract's verdict on each parallel run (none when the settings differ: nothing to hold)."""
    if mismatches:
        return []
    verdicts = [judge(label, differences(runs[0][1], records), runs[0][1], records) for label, records in runs[1:]]
    if (config_of(runs[0][1]) or {}).get("args", {}).get("activation") == "relu":
        for v in verdicts:   # the known way a stable program leaves the contract: say it with the breach
            v.note = "ReLU's kinks let float32 rounding grow past it over a long run (docs/equivalence.md)"
    return verdicts


def plot_curves(paths, out, beside=()):
    """{label: largest |loss - baseline|} of each parallel run, after drawing them all into `out`."""
    return draw(paths, out, beside)[0]


def draw(paths, out, beside=()):
    """The figure, and ({label: largest difference}, [contract.Verdict]). beside: logs drawn next to the
    others (dotted) but not held to the contract: the synchronous baseline beside 2bw and its --delay 1
    reference, where the gap is what staleness costs."""
    runs = [(label_of(recs, p), recs) for p, recs in ((p, read_json_lines(p)) for p in paths)]
    others = [(label_of(recs, p), recs) for p, recs in ((p, read_json_lines(p)) for p in beside)]
    if not series(runs[0][1], "train", "loss")[0]:
        fail(f"{paths[0]} has no training steps; was the run finished?")
    mismatches = setting_differences(runs)
    for m in mismatches:
        print(f"warning: not comparable step by step: {m}", file=sys.stderr)
    verdicts = verdicts_of(runs, mismatches)
    panels = ["loss"] + (["diff"] if len(runs) > 1 else [])
    panels += ["acc"] if any(series(recs, "eval", "test_acc")[0] for _, recs in runs) else []
    panels += ["experts"] if expert_loads(runs) else []
    note = few_evaluations(runs) if "acc" in panels else None
    text = (config_of(runs[0][1]) or {}).get("args", {}).get("model") == "gpt"   # its accuracy: of the next byte
    rows = 2 if len(panels) == 4 else 1     # four panels as two rows of two: legible at the README's width
    cols = len(panels) // rows
    fig, axes = plt.subplots(rows, cols, squeeze=False,
                             figsize=(6 * cols, rows * (4.8 - 0.4 * (rows - 1) + legend_height(runs, others, note))))
    ax = dict(zip(panels, axes.flat))
    draw_runs(ax, runs, verdicts)
    load = draw_expert_load(ax["experts"], expert_loads(runs), runs) if "experts" in ax else None
    for label, records in others:
        shown = label + " [beside: not compared]"
        ax["loss"].plot(*series(records, "train", "loss"), label=shown, lw=1.2, ls=":", color="tab:grey")
        if "acc" in ax:
            ax["acc"].plot(*series(records, "eval", "test_acc"), marker="x", ls=":", color="tab:grey", label=shown)
        gap = max((d for _, d in differences(runs[0][1], records)), default=float("nan"))
        print(f"drawn beside, not compared: {label}: largest |loss - {runs[0][0]}| {gap:.3g}")
    label_axes(ax, note, text)
    broken = mismatches or any(not v.holds for v in verdicts)
    fig.suptitle(title_of(runs, mismatches, verdicts), color="red" if broken else "black")
    diffs = largest_differences(runs)
    save(fig, out, {"kind": "curves", "runs": [run_summary(label, records, diffs.get(label))
                                               for label, records in runs],
                    "beside": [run_summary(label, records, None) for label, records in others],
                    "verdicts": [{"label": v.label, "holds": v.holds, "routing_first_differs": v.parted,
                                  "largest_difference_before": v.before, "breach": v.breach} for v in verdicts],
                    **({"expert_load": load} if load else {})})
    return diffs, verdicts


def identical_to(runs):
    """{i: j}: run i logged the same training losses at the same steps as the earlier run j (the
    first such; 0 is the baseline). Bit for bit (==), not "within what is visible": every run that
    keeps the 1e-4 contract lies within a pixel of the baseline on a loss axis, so the eye cannot
    tell them apart and "identical" would name them all. Bit-identical is a fact a student can check
    in the logs, and it is the case where one line hides another in every panel, the difference
    panel included (GPipe and 1F1B compute the same sums, only scheduled in another order)."""
    losses = [series(records, "train", "loss") for _, records in runs]
    return {i: next(j for j in range(i) if losses[j] == losses[i])
            for i in range(1, len(runs)) if losses[i] in losses[:i]}


def legend_label(runs, i, twins):
    """The run's label, and on a second line the earlier run whose losses it repeats bit for bit."""
    if i not in twins:
        return wrapped(runs[i][0])
    return wrapped(runs[i][0]) + ("\n= baseline (bit-identical losses)" if twins[i] == 0
                                  else f"\nidentical to {runs[twins[i]][0]}")


def wrapped(label):
    """A label in lines of at most 72 characters: a legend sits centred under its 6-inch panel, so a longer
    line (parallel_5d's settings run to 100) would reach past the figure's edge and be cut off."""
    return textwrap.fill(label, 72, break_long_words=False, break_on_hyphens=False)


MARKERS = "os^Dv<>p"
DASH = 5   # points of one dash; the parallel runs take turns along a cycle of one dash each


def run_style(i, count):
    """Run i's colour, marker and dashes, the same in every panel. The parallel runs' dashes take turns
    (of every count - 1 dashes, run i draws the i-th): runs within the contract lie within a pixel of
    each other, and plain dashed lines would let the last one drawn hide the rest."""
    if i == 0:   # the baseline wide and pale underneath, so curves that match it sit visibly on top
        return {"lw": 3, "color": "black", "alpha": 0.3}
    parallel = count - 1
    dashes = (0, (DASH, DASH)) if parallel == 1 else ((i - 1) * DASH, (DASH, (parallel - 1) * DASH))
    return {"lw": 1.4, "color": f"C{(i - 1) % 10}", "marker": MARKERS[(i - 1) % len(MARKERS)], "ls": dashes}


def marks(i, count, points, per_line=12):
    """markevery for run i: about per_line markers, each parallel run's between the others', so two
    runs on one line show both marker shapes instead of one on top of the other."""
    parallel = max(1, count - 1)
    every = max(parallel, -(-points // per_line))
    return ((i - 1) * every // parallel, every)


def draw_runs(ax, runs, verdicts=()):
    """Every run in every panel: training loss, its difference from the baseline, test accuracy."""
    twins, few = identical_to(runs), few_evaluations(runs)
    parted = {v.label: v.parted for v in verdicts}
    for i, (label, records) in enumerate(runs):
        style, shown = run_style(i, len(runs)), legend_label(runs, i, twins)
        steps, losses = series(records, "train", "loss")
        ax["loss"].plot(steps, losses, label=wrapped(label + " [baseline]") if i == 0 else shown,
                        markevery=marks(i, len(runs), len(steps)) if i else None, **style)
        if "acc" in ax:
            ax["acc"].plot(*series(records, "eval", "test_acc"), label=shown, **accuracy_style(style, i, few))
        if i > 0:
            draw_differences(ax["diff"], differences(runs[0][1], records), shown, style, i, len(runs))
            if parted.get(label) is not None:
                mark_parting(ax["diff"], parted[label], style["color"])
                after = running_differences(runs[0][1], records, parted[label])
                ax["diff"].plot(*zip(*after), color=style["color"], lw=2, ls=":", alpha=0.8,   # not the run's dashes
                                label=f"after step {parted[label]}: |{WINDOW}-step running means' difference|")
    if "diff" in ax and len(runs) > 1:
        draw_limits(ax["diff"], runs, [p for p in parted.values() if p is not None])


def accuracy_style(style, i, few):
    """Every evaluation marked. The baseline's a wide open ring drawn over the others, the parallel
    runs' filled dots inside it, smaller for each later run: equal values show as a dot in a ring,
    not one marker hiding another."""
    if i == 0:
        points = {"color": "black", "marker": "o", "markersize": 13, "markerfacecolor": "none",
                  "markeredgewidth": 1.5, "alpha": 0.55, "lw": 2.5, "zorder": 3}
    else:
        points = {**style, "marker": style.get("marker", "o"), "markersize": max(3, 7 - 1.5 * (i - 1))}
    if few:      # a line through two or three points would claim a trend they cannot show
        points["ls"] = "none"
    return points


def mark_parting(ax, step, colour):
    """The step where the run's routing first differs from the baseline's: from there the contract
    no longer applies (mp.tools.contract), and the panel says so where it happens."""
    ax.axvline(step, color=colour, lw=1, ls="-.", alpha=0.8,
               label=f"routing first differs: step {step}\n(a near-tie tipped; from here the runs part)")


MIN_EVALUATIONS = 4   # fewer points than this are no trend: one evaluation's wobble decides the slope


def few_evaluations(runs):
    """The note for an accuracy panel of fewer than MIN_EVALUATIONS evaluations (None for more): what
    the points can and cannot say, and why accuracy may fall while the test loss falls."""
    base = [r for r in runs[0][1] if r["event"] == "eval"]
    count = max(sum(r["event"] == "eval" for r in records) for _, records in runs)
    if count >= MIN_EVALUATIONS or not base:
        return None
    if len(base) == 1:
        note = f"1 evaluation (step {base[0]['step']}): a single point, no trend."
    else:
        note = (f"{len(base)} evaluations (steps {', '.join(str(r['step']) for r in base)}): too few to show "
                f"a trend,\ndrawn as points, not a line. Accuracy counts each test sample's\ntop guess only; "
                f"the test loss also weighs how sure the model is,\nso the two can move apart between "
                f"nearby evaluations.\nbaseline: test loss {base[0]['test_loss']:.3g} -> {base[-1]['test_loss']:.3g}, "
                f"accuracy {base[0]['test_acc']:.1%} -> {base[-1]['test_acc']:.1%}")
    return note + "\nFor a curve: more --steps or a smaller --eval-every (EVAL_EVERY)."


def label_axes(ax, note=None, text=False):
    """Titles, axes, and each panel's legend below it, outside the data: inside, "best" dodges the
    lines but not a note, and at some --steps no corner is free of both. The accuracy panel's note
    heads its legend, so nothing can cover it (tests/test_plots.py checks the boxes). text (the gpt): the
    accuracy is of each held-out byte's prediction of the next, chance 1/256; its loss is per byte."""
    ax["loss"].set(xlabel="step", ylabel="training loss" + (" (nats per byte)" if text else ""), title="training loss")
    if "acc" in ax:
        what = "next-byte accuracy (held-out text)" if text else "test accuracy"
        ax["acc"].axhline(1 / 256 if text else 0.1, color="grey", lw=1, ls=":", label="chance")
        ax["acc"].set(xlabel="step", ylabel=what, title=what, ylim=(0, 1))
    for name, a in ax.items():
        if name != "loss":      # one step axis in every panel (a run equal to the baseline draws no difference)
            a.set_xlim(ax["loss"].get_xlim())
        a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))   # whole steps: no step 2.5
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False,
                 title=note if name == "acc" else None, title_fontsize=7, alignment="left")


def legend_height(runs, others, note):
    """Inches the legends below the panels take: a line a label line, and the accuracy panel's note;
    the experts' panel: a line an expert, even load and dropped."""
    twins = identical_to(runs)
    lines = sum(1 + legend_label(runs, i, twins).count("\n") for i in range(len(runs))) + len(others) + 1
    loads = expert_loads(runs)
    experts = len(loads[0][1]["tokens_per_expert"][0][0]) + 2 if loads else 0
    return 0.3 + 0.15 * max(lines + (1 + note.count("\n") if note else 0), experts)


def run_summary(label, records, difference):
    """What the figure's PNG records about one run (tests/test_figures.py reads it back)."""
    config = config_of(records) or {}
    evals = [r for r in records if r["event"] == "eval"]
    return {"label": label, "program": config.get("program"), "world_size": config.get("world_size"),
            "args": config.get("args", {}), "train_steps": sum(r["event"] == "train" for r in records),
            "final_loss": next((r["loss"] for r in reversed(records) if r["event"] == "train"), None),
            "final_test_acc": evals[-1]["test_acc"] if evals else None, "largest_difference": difference}


def draw_differences(ax, pairs, label, style, i, count):
    """The largest |loss - baseline| per window of steps, as a line on a log scale. A window whose steps
    are all exactly equal to the baseline's has no value on a log scale: it is left as a gap, not drawn
    as a dip that would look like an event, and the panel says so."""
    if not pairs:
        return
    maxima, size = window_maxima(pairs)
    steps, worst = zip(*maxima)
    ax.set_yscale("log")
    ax.set_ylim(1e-10, 1)   # before the curve: a curve of gaps only would leave no range to scale
    ax.plot(steps, [d if d > 0 else float("nan") for d in worst], label=label,
                markevery=marks(i, count, len(steps)), **{**style, "lw": 1.2})
    ax.set(xlabel="step",
           ylabel="|loss - baseline loss|" + (f", largest per {size} steps" if size > 1 else ""),
           title=f"difference from the baseline\n(red: the contract, {LIMIT}; a gap: exactly equal)")


def draw_limits(ax, runs, parted):
    """The contract's red line over the steps it covers: every step, or up to where a run's routing first
    differs; from there the band its running means must stay in (orange)."""
    last = max(max(series(records, "train", "loss")[0], default=0) for _, records in runs)
    end = min(parted) if parted else last
    ax.hlines(TOLERANCE, 0, end, color="red", lw=1, ls=":")
    if parted:
        ax.hlines(BAND, end, last, color="tab:orange", lw=1.2, ls=":",
                  label=f"from step {end}: the band ({BAND:g}) the running means keep")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="metrics logs (first = baseline), or traces with --timeline")
    p.add_argument("-o", "--out", required=True, help="PNG to write")
    p.add_argument("--timeline", action="store_true", help="the files are pipeline timelines")
    p.add_argument("--beside", nargs="+", default=[], metavar="LOG",
                   help="logs drawn next to the curves but not compared with the first (e.g. the synchronous "
                        "baseline beside 2bw and its single_baseline.py --delay 1 reference)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)   # from here, KeyboardInterrupt: save() cleans up
    for path in args.files + args.beside:
        if not os.path.exists(path):
            fail(f"{path} does not exist; run the program that writes it first")
    try:
        if args.timeline:
            plot_timelines(args.files, args.out)
            return
        verdicts = draw(args.files, args.out, args.beside)[1]
    except KeyboardInterrupt:   # Ctrl-C: one line, no traceback; save() has removed its partial file
        print(f"interrupted: {args.out} not written", file=sys.stderr)
        sys.exit(130)
    if not verdicts and len(args.files) > 1:   # settings differ: drawn, named in the title, not judged
        print("not comparable step by step (the settings differ, see the warnings): the contract not checked")
    for v in verdicts:          # what holds for each run; a broken contract last, on stderr, and exit 1
        if v.holds:
            print(sentence(v))
    broken = [v for v in verdicts if not v.holds]
    for v in broken:
        print(breach_line(v), file=sys.stderr)
    if broken:
        sys.exit(1)


if __name__ == "__main__":
    main()
