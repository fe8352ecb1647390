"""Run every benchmark in one invocation and rewrite docs/benchmarks.md
(between its benchmarks:begin/end markers) and plots/pipeline_memory.png.

    bash benchmarks/run.sh            # = python benchmarks/report.py (about 6-8 minutes on 2 cores)

Four launches of benchmarks/bench.py (pipeline on 4 ranks; tensor parallelism at degrees 2 and 4),
twelve of pipeline_microbatch.py itself (peak memory of gpipe, gpipe --recompute, 1f1b and zb at
m = 10, 100, 1000: a per-process high-water mark, so each point needs fresh processes) and
benchmarks/zero_bubble.py (zb against 1f1b, and --recompute's cost, on 2 stages). Raw results go to logs/bench/.
"""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mp.flags import OneLineParser  # noqa: E402

LOGS = os.path.join(ROOT, "logs", "bench")
MODEL = ["--layers", "8", "--hidden", "512", "--batch-size", "256"]
MEMORY_MB = 4   # samples per microbatch in the memory runs: global batch = 4 x m, so GPipe holds O(m)
MEMORY_RUNS = {"gpipe": ["--schedule", "gpipe"], "gpipe --recompute": ["--schedule", "gpipe", "--recompute"],
               "1f1b": ["--schedule", "1f1b"], "zb": ["--schedule", "zb"]}
BEGIN, END = "<!-- benchmarks:begin (written by benchmarks/report.py) -->", "<!-- benchmarks:end -->"


def torchrun(nproc, script, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--", os.path.join(ROOT, script), *args]
    print("$", " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        sys.exit(f"error: {script} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def run_all(repeat):
    os.makedirs(LOGS, exist_ok=True)
    common = ["--warmup", "3", "--repeat", str(repeat)]
    torchrun(4, "benchmarks/bench.py", ["pipeline", "--out", f"{LOGS}/pipeline.json", *MODEL, *common])
    for degree in (2, 4):
        torchrun(degree, "benchmarks/bench.py", ["tp", "--out", f"{LOGS}/tp{degree}.json", *MODEL, *common])
    run_memory()
    run_zero_bubble()


def run_zero_bubble():                 # it launches its own 2-rank runs
    print("$ benchmarks/zero_bubble.py", flush=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "zero_bubble.py"), "--out",
                    f"{LOGS}/zero_bubble.json"], cwd=ROOT, check=True, timeout=1800)


def run_memory():
    for name, flags in MEMORY_RUNS.items():
        for m in (10, 100, 1000):
            torchrun(4, "pipeline_microbatch.py", [
                "--model", "cnn", "--data", "synthetic", "--microbatches", str(m), *flags,
                "--batch-size", str(MEMORY_MB * m), "--steps", "2", "--eval-every", "0",
                "--log-file", f"{LOGS}/memory-{name.replace(' ', '')}-{m}.jsonl"])


def load():
    with open(f"{LOGS}/pipeline.json") as f:
        pipeline = json.load(f)
    tp_rows = []
    for degree in (2, 4):
        with open(f"{LOGS}/tp{degree}.json") as f:
            tp_rows += json.load(f)["rows"]
    with open(f"{LOGS}/zero_bubble.json") as f:
        zero_bubble = json.load(f)["rows"]
    return pipeline, tp_rows, load_memory(), zero_bubble


def load_memory():
    memory = {}
    for name in MEMORY_RUNS:
        for m in (10, 100, 1000):
            with open(f"{LOGS}/memory-{name.replace(' ', '')}-{m}.jsonl") as f:
                summary = [json.loads(line) for line in f if '"summary"' in line][-1]
            memory[(name, m)] = {int(r): mb for r, mb in summary["peak_memory_mb"].items()}
    return memory


def markdown_table(header, rows):
    """A markdown table's lines: the header's cells, the rule, then one line of cells per row."""
    return ["| " + " | ".join(cells) + " |" for cells in [header, ["---"] * len(header), *rows]]


def speed_table(rows):
    header = ["config", "ours ms", "torch ms", "**ours / torch**", "paired ours / torch", "baseline ms",
              "baseline / ours (speed-up)", "baseline / torch", "loss diff vs torch"]
    return markdown_table(header, [
        [r["config"], f"{1e3 * r['ours_s']:.1f}", f"{1e3 * r['torch_s']:.1f}", f"**{r['ours_over_torch']:.2f}**",
         f"{r['paired_ours_over_torch']:.2f}", f"{1e3 * r['baseline_s']:.1f}", f"{r['baseline_over_ours']:.2f}",
         f"{r['baseline_over_torch']:.2f}", f"{r['max_loss_diff_vs_torch']:.1e}"] for r in rows])


def verdict(rows):
    over = [r for r in rows if r["ours_over_torch"] > 1.0]
    if not over:
        return "In this run our step time is at most torch's on every row (ours / torch <= 1.0)."
    return (f"In this run ours / torch is <= 1.0 on {len(rows) - len(over)} of {len(rows)} rows; above 1.0: "
            + "; ".join(f"{r['config']} {r['ours_over_torch']:.3f} (paired {r['paired_ours_over_torch']:.3f})"
                        for r in over) + ".")


def bubble_table(bubbles):
    header = ["schedule", "m", "theory (p-1)/(vm+p-1)", "measured (median of 5 steps)", "measured - theory"]
    return markdown_table(header, [
        [b["schedule"], str(b["microbatches"]), f"{b['theory']:.3f}", f"{b['measured']:.3f}",
         f"{b['measured'] - b['theory']:+.3f}"] for b in bubbles])


def memory_table(memory):
    ranks = sorted(next(iter(memory.values())))
    lines = markdown_table(["schedule", "m", "global batch"] + [f"stage {r} MB" for r in ranks],
                           [[schedule, str(m), str(MEMORY_MB * m)] + [f"{mb[r]:.0f}" for r in ranks]
                            for (schedule, m), mb in memory.items()])
    at = {name: memory[(name, 1000)][0] for name in MEMORY_RUNS}
    growth = {name: max(memory[(name, 1000)][r] - memory[(name, 10)][r] for r in ranks) for name in MEMORY_RUNS}
    lines.append("")
    lines.append("At m = 1000, stage 0 peaks at " + ", ".join(f"{mb:.0f} MB under {name}" for name, mb in at.items())
                 + "; from m = 10 to 1000 the most any stage grows is "
                 + ", ".join(f"{mb:+.0f} MB under {name}" for name, mb in growth.items()) + ".")
    return lines


def zero_bubble_table(rows):
    header = ["configuration", "stages", "m", "step ms (median)", "/ 1f1b (paired, median)", "bubble measured",
              "bubble theory", "ms per step on each stage: F forward, B backward, W weight gradient, R recompute"]
    return markdown_table(header, [
        [r["config"], str(r.get("stages", 2)), str(r["microbatches"]), f"{1e3 * r['step_s']:.0f}",
         f"{r['over_1f1b']:.2f}", f"{r['bubble_measured']:.3f}", f"{r['bubble_theory']:.3f}",
         "; ".join(" ".join(f"{k} {v:.0f}" for k, v in kinds.items()) for kinds in r.get("split_ms", {}).values())]
        for r in rows])


def plot_memory(memory, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ms = sorted({m for _, m in memory})
    ranks = sorted(next(iter(memory.values())))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"gpipe": "-o", "gpipe --recompute": "-.^", "1f1b": "--s", "zb": ":x"}
    for name, style in styles.items():
        for r in ranks:
            ax.plot(ms, [memory[(name, m)][r] for m in ms], style, color=f"C{r}", label=f"{name} stage {r}")
    ax.set_xscale("log")
    ax.set_xlabel(f"microbatches m ({MEMORY_MB} samples each; global batch {MEMORY_MB} m)")
    ax.set_ylabel("peak resident memory per stage (MB)")
    ax.set_title("cnn, 4 stages: GPipe's stage 0 grows with m (every microbatch's activations), less with\n"
                 "--recompute (only every microbatch's input); 1F1B and zb stay flat on every stage", fontsize=9)
    ax.legend(fontsize=6, ncol=4)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)


def write_doc(pipeline, tp_rows, memory, zero_bubble, command, seconds):
    with open(os.path.join(ROOT, "benchmarks", "doc_template.md")) as f:
        template = f.read()
    args = pipeline["args"]
    text = template.format(
        command=command, seconds=f"{seconds / 60:.1f} min" if seconds else "see logs/bench",
        repeat=args["repeat"], warmup=args["warmup"],
        pipeline_table="\n".join(speed_table(pipeline["rows"])),
        tp_table="\n".join(speed_table(tp_rows)),
        bubble_table="\n".join(bubble_table(pipeline["bubble"])),
        memory_table="\n".join(memory_table(memory)),
        zero_bubble_table="\n".join(zero_bubble_table(zero_bubble)),
        verdict=verdict(pipeline["rows"] + tp_rows))
    doc = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(doc) as f:
        before, rest = f.read().split(BEGIN, 1)
        after = rest.split(END, 1)[1]
    with open(doc, "w") as f:
        f.write(before + BEGIN + "\n" + text.strip() + "\n" + END + after)


def main():
    p = OneLineParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=10, help="timed steps per engine and configuration")
    p.add_argument("--no-run", action="store_true", help="only rewrite docs/benchmarks.md and plot from logs/bench")
    p.add_argument("--frontier-only", action="store_true",
                   help="only the memory runs and benchmarks/zero_bubble.py: redraw the plot, print their tables")
    p.add_argument("--data-axis", action="store_true",
                   help="only benchmarks/data_axis.py (ours against DDP, FSDP2 and ZeroRedundancyOptimizer, paired): "
                        "print the table that docs/benchmarks.md's section of that name quotes")
    args = p.parse_args()
    if args.data_axis:                 # its own torchruns, one per engine: a peak resident set cannot be reset
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "data_axis.py"), "--out",
                        f"{LOGS}/data_axis.json"], cwd=ROOT, check=True, timeout=3600)
        return
    if args.frontier_only:
        run_memory()
        run_zero_bubble()
        memory = load_memory()
        plot_memory(memory, os.path.join(ROOT, "plots", "pipeline_memory.png"))
        with open(f"{LOGS}/zero_bubble.json") as f:
            print("\n".join(memory_table(memory) + [""] + zero_bubble_table(json.load(f)["rows"])))
        return
    start = time.perf_counter()
    if not args.no_run:
        run_all(args.repeat)
    seconds_file = os.path.join(LOGS, "run_seconds.txt")
    if not args.no_run:
        with open(seconds_file, "w") as f:
            f.write(f"{time.perf_counter() - start:.0f}\n")
    seconds = float(open(seconds_file).read()) if os.path.exists(seconds_file) else None
    pipeline, tp_rows, memory, zero_bubble = load()
    plot_memory(memory, os.path.join(ROOT, "plots", "pipeline_memory.png"))
    repeat = pipeline["args"]["repeat"]
    write_doc(pipeline, tp_rows, memory, zero_bubble,
              "bash benchmarks/run.sh" + (f" --repeat {repeat}" if repeat != 10 else ""),
              seconds)
    print(f"rewrote docs/benchmarks.md and plots/pipeline_memory.png ({seconds or 0:.0f} s)")


if __name__ == "__main__":
    main()
