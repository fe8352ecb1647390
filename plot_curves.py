"""Draw what the programs logged: loss curves against the baseline, and pipeline timelines.

    python plot_curves.py logs/single_baseline.jsonl logs/pipeline_1f1b.jsonl -o plots/pipeline_loss.png
    python plot_curves.py --timeline logs/timeline_gpipe.json logs/timeline_1f1b.json -o plots/pipeline_timeline.png

Curves: the first log is the baseline. One figure: training loss of every log, test accuracy where
logged, and |loss - baseline loss| per step on a log scale with the 1e-4 contract line.
Timelines: Chrome-trace files (DESIGN.md) drawn as Gantt charts, one above the other: a row per
rank, forward / backward / communication wait in distinct colours, microbatch numbers on the boxes.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no screen on the machines that draw these
import matplotlib.pyplot as plt  # noqa: E402

TOLERANCE = 1e-4  # the equivalence contract (DESIGN.md)
COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "wait": "#C0C0C0"}


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_json_lines(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        fail(f"cannot read metrics log {path}: {e}")


def label_of(records, path):
    """A short name for a run: program plus the settings that tell runs of it apart."""
    config = next((r for r in records if r["event"] == "config"), None)
    if config is None:
        return os.path.basename(path)
    args, parts = config["args"], []
    for key in ("schedule", "dp", "microbatches"):
        if args.get(key) is not None:
            parts.append(f"{'m' if key == 'microbatches' else key}={args[key]}" if key != "schedule"
                         else str(args[key]))
    if args.get("hybrid"):
        parts.append("hybrid")
    if config["world_size"] > 1:
        parts.append(f"{config['world_size']} ranks")
    if not any(r["event"] == "summary" for r in records):   # the run stopped before its end
        steps = sum(r["event"] == "train" for r in records)
        print(f"warning: {path} has no summary record: the run stopped after {steps} steps", file=sys.stderr)
        parts.append(f"INCOMPLETE: {steps} of {config['args'].get('steps', '?')} steps")
    return config["program"] + (f" ({', '.join(parts)})" if parts else "")


def series(records, event, key):
    rows = [r for r in records if r["event"] == event]
    return [r["step"] for r in rows], [r[key] for r in rows]


def largest_differences(runs):
    """{label: max |loss - baseline loss|} over the steps both logged, for every run but the baseline."""
    _, base_losses = series(runs[0][1], "train", "loss")
    out = {}
    for label, records in runs[1:]:
        _, losses = series(records, "train", "loss")
        n = min(len(losses), len(base_losses))
        out[label] = max((abs(a - b) for a, b in zip(losses[:n], base_losses[:n])), default=float("nan"))
    return out


def title_of(runs):
    args = next((r["args"] for r in runs[0][1] if r["event"] == "config"), {})
    data = args.get("data", "?")
    data = "SYNTHETIC data (not CIFAR-10)" if data == "synthetic" else data.upper()
    title = f"model {args.get('model', '?')}, {data}, global batch {args.get('batch_size', '?')}"
    diffs = largest_differences(runs)
    if diffs:
        title += f"\nlargest |loss - baseline| = {max(diffs.values()):.2e} (contract: {TOLERANCE:g})"
    return title


def plot_curves(paths, out):
    runs = [(label_of(recs, p), recs) for p, recs in ((p, read_json_lines(p)) for p in paths)]
    if not series(runs[0][1], "train", "loss")[0]:
        fail(f"{paths[0]} has no training steps; was the run finished?")
    panels = ["loss"] + (["diff"] if len(runs) > 1 else [])
    panels += ["acc"] if any(series(recs, "eval", "test_acc")[0] for _, recs in runs) else []
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    ax = dict(zip(panels, axes[0]))
    base_losses = series(runs[0][1], "train", "loss")[1]
    for i, (label, records) in enumerate(runs):
        # the baseline wide and pale underneath, so curves that match it sit visibly on top
        style = {"lw": 3, "color": "black", "alpha": 0.3} if i == 0 else {"lw": 1.2, "ls": "--"}
        ax["loss"].plot(*series(records, "train", "loss"), label=label + (" [baseline]" if i == 0 else ""), **style)
        if "acc" in ax:
            ax["acc"].plot(*series(records, "eval", "test_acc"), marker="o", label=label, **style)
        if i > 0:
            steps, losses = series(records, "train", "loss")
            n = min(len(losses), len(base_losses))
            diff = [max(abs(a - b), 1e-12) for a, b in zip(losses[:n], base_losses[:n])]  # log axis: no zeros
            ax["diff"].semilogy(steps[:n], diff, lw=1, label=label)
    ax["loss"].set(xlabel="step", ylabel="training loss", title="training loss")
    if "diff" in ax:
        ax["diff"].axhline(TOLERANCE, color="red", lw=1, ls=":", label=f"contract {TOLERANCE:g}")
        ax["diff"].set(xlabel="step", ylabel="|loss - baseline loss|  (exact: drawn at 1e-12)",
                       title="difference from the baseline (log)")
    if "acc" in ax:
        ax["acc"].axhline(0.1, color="grey", lw=1, ls=":", label="chance")
        ax["acc"].set(xlabel="step", ylabel="test accuracy", title="test accuracy", ylim=(0, 1))
    for a in ax.values():
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title_of(runs))
    save(fig, out)
    return largest_differences(runs)


def plot_timelines(paths, out):
    fig, axes = plt.subplots(len(paths), 1, figsize=(13, 1.2 + 0.9 * 4 * len(paths)), squeeze=False)
    for ax, path in zip(axes[:, 0], paths):
        try:
            with open(path) as f:
                trace = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            fail(f"cannot read timeline {path}: {e}")
        draw_gantt(ax, trace)
    save(fig, out)


def draw_gantt(ax, trace):
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not events:
        fail("the timeline has no events")
    start = min(e["ts"] for e in events)
    ranks = sorted({e["pid"] for e in events})
    for e in events:
        kind = e.get("cat", "wait")
        left, width = (e["ts"] - start) / 1000, e["dur"] / 1000
        ax.barh(e["pid"], width, left=left, height=0.8, color=COLOURS.get(kind, "#999999"),
                edgecolor="white" if kind != "wait" else "none", linewidth=0.5)
        mb = e.get("args", {}).get("microbatch")
        if kind != "wait" and mb is not None:
            ax.text(left + width / 2, e["pid"], str(mb), ha="center", va="center", fontsize=7, color="white")
    other = trace.get("otherData", {})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()  # stage 0 on top, as pipelines are drawn in papers
    ax.set_xlabel("time in the step (ms)")
    chunks = f", v={other['virtual_stages']}" if other.get("schedule") == "interleaved" else ""
    ax.set_title(f"{other.get('schedule', '?')}: {other.get('stages', '?')} stages, "
                 f"{other.get('microbatches', '?')} microbatches{chunks}; bubble measured "
                 f"{other.get('bubble_measured', float('nan')):.1%}, theory {other.get('bubble_theory', float('nan')):.1%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, ["forward", "backward", "waiting for a message"], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)


def save(fig, out):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="metrics logs (first = baseline), or traces with --timeline")
    p.add_argument("-o", "--out", required=True, help="PNG to write")
    p.add_argument("--timeline", action="store_true", help="the files are pipeline timelines")
    args = p.parse_args(argv)
    for path in args.files:
        if not os.path.exists(path):
            fail(f"{path} does not exist; run the program that writes it first")
    if args.timeline:
        plot_timelines(args.files, args.out)
        return
    for label, diff in plot_curves(args.files, args.out).items():
        print(f"largest |loss - baseline| for {label}: {diff:.3g}")


if __name__ == "__main__":
    main()
