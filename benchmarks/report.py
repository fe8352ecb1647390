"""Run every benchmark in one invocation and rewrite docs/benchmarks.md
(between its benchmarks:begin/end markers) and plots/pipeline_memory.png.

    bash benchmarks/run.sh            # = python benchmarks/report.py (about 6-8 minutes on 2 cores)

Four launches of benchmarks/bench.py (pipeline on 4 ranks; tensor parallelism at degrees 2 and 4)
and six of pipeline_microbatch.py itself (peak memory, which is a per-process high-water mark, so
each point needs fresh processes). Raw results go to logs/bench/.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGS = os.path.join(ROOT, "logs", "bench")
MODEL = ["--layers", "8", "--hidden", "512", "--batch-size", "256"]
MEMORY_MB = 4   # samples per microbatch in the memory runs: global batch = 4 x m, so GPipe holds O(m)
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
    for schedule in ("gpipe", "1f1b"):
        for m in (10, 100, 1000):
            torchrun(4, "pipeline_microbatch.py", [
                "--model", "cnn", "--data", "synthetic", "--schedule", schedule, "--microbatches", str(m),
                "--batch-size", str(MEMORY_MB * m), "--steps", "2", "--eval-every", "0",
                "--log-file", f"{LOGS}/memory-{schedule}-{m}.jsonl"])


def load():
    with open(f"{LOGS}/pipeline.json") as f:
        pipeline = json.load(f)
    tp_rows = []
    for degree in (2, 4):
        with open(f"{LOGS}/tp{degree}.json") as f:
            tp_rows += json.load(f)["rows"]
    memory = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (10, 100, 1000):
            with open(f"{LOGS}/memory-{schedule}-{m}.jsonl") as f:
                summary = [json.loads(line) for line in f if '"summary"' in line][-1]
            memory[(schedule, m)] = {int(r): mb for r, mb in summary["peak_memory_mb"].items()}
    return pipeline, tp_rows, memory


def speed_table(rows):
    head = ("| config | ours ms | torch ms | **ours / torch** | paired ours / torch | baseline ms | "
            "baseline / ours (speed-up) | baseline / torch | loss diff vs torch |")
    lines = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for r in rows:
        lines.append(f"| {r['config']} | {1e3 * r['ours_s']:.1f} | {1e3 * r['torch_s']:.1f} | "
                     f"**{r['ours_over_torch']:.2f}** | {r['paired_ours_over_torch']:.2f} | "
                     f"{1e3 * r['baseline_s']:.1f} | {r['baseline_over_ours']:.2f} | "
                     f"{r['baseline_over_torch']:.2f} | {r['max_loss_diff_vs_torch']:.1e} |")
    return lines


def verdict(rows):
    over = [r for r in rows if r["ours_over_torch"] > 1.0]
    if not over:
        return "In this run our step time is at most torch's on every row (ours / torch <= 1.0)."
    return (f"In this run ours / torch is <= 1.0 on {len(rows) - len(over)} of {len(rows)} rows; above 1.0: "
            + "; ".join(f"{r['config']} {r['ours_over_torch']:.3f} (paired {r['paired_ours_over_torch']:.3f})"
                        for r in over) + ".")


def bubble_table(bubbles):
    lines = ["| schedule | m | theory (p-1)/(vm+p-1) | measured (median of 5 steps) | measured - theory |",
             "| --- | --- | --- | --- | --- |"]
    for b in bubbles:
        lines.append(f"| {b['schedule']} | {b['microbatches']} | {b['theory']:.3f} | {b['measured']:.3f} | "
                     f"{b['measured'] - b['theory']:+.3f} |")
    return lines


def memory_table(memory):
    ranks = sorted(next(iter(memory.values())))
    lines = ["| schedule | m | global batch | " + " | ".join(f"stage {r} MB" for r in ranks) + " |",
             "|" + " --- |" * (3 + len(ranks))]
    for (schedule, m), mb in memory.items():
        lines.append(f"| {schedule} | {m} | {MEMORY_MB * m} | " + " | ".join(f"{mb[r]:.0f}" for r in ranks) + " |")
    g, o = memory[("gpipe", 1000)], memory[("1f1b", 1000)]
    lines.append("")
    lines.append(f"At m = 1000, stage 0 peaks at {g[0]:.0f} MB under GPipe and {o[0]:.0f} MB under 1F1B "
                 f"(+{g[0] - o[0]:.0f} MB); from m = 10 to 1000 GPipe's stage 0 grows by "
                 f"{g[0] - memory[('gpipe', 10)][0]:.0f} MB, 1F1B's by {o[0] - memory[('1f1b', 10)][0]:.0f} MB.")
    return lines


def plot_memory(memory, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ms = sorted({m for _, m in memory})
    ranks = sorted(next(iter(memory.values())))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for schedule, style in (("gpipe", "-o"), ("1f1b", "--s")):
        for r in ranks:
            ax.plot(ms, [memory[(schedule, m)][r] for m in ms], style, color=f"C{r}",
                    label=f"{schedule} stage {r}")
    ax.set_xscale("log")
    ax.set_xlabel(f"microbatches m ({MEMORY_MB} samples each; global batch {MEMORY_MB} m)")
    ax.set_ylabel("peak resident memory per stage (MB)")
    # what the curves show: 1F1B's stage 0 grows too, with the global batch of inputs it draws
    ax.set_title("cnn, 4 stages: GPipe's stage 0 grows with m (it keeps every microbatch's activations);\n"
                 "1F1B's stage 0 grows less (only the global batch of inputs); stages 1-3 stay near the floor",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)


def write_doc(pipeline, tp_rows, memory, command, seconds):
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
        verdict=verdict(pipeline["rows"] + tp_rows))
    doc = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(doc) as f:
        before, rest = f.read().split(BEGIN, 1)
        after = rest.split(END, 1)[1]
    with open(doc, "w") as f:
        f.write(before + BEGIN + "\n" + text.strip() + "\n" + END + after)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=10, help="timed steps per engine and configuration")
    p.add_argument("--no-run", action="store_true", help="only rewrite docs/benchmarks.md and plot from logs/bench")
    args = p.parse_args()
    start = time.perf_counter()
    if not args.no_run:
        run_all(args.repeat)
    seconds_file = os.path.join(LOGS, "run_seconds.txt")
    if not args.no_run:
        with open(seconds_file, "w") as f:
            f.write(f"{time.perf_counter() - start:.0f}\n")
    seconds = float(open(seconds_file).read()) if os.path.exists(seconds_file) else None
    pipeline, tp_rows, memory = load()
    plot_memory(memory, os.path.join(ROOT, "plots", "pipeline_memory.png"))
    repeat = pipeline["args"]["repeat"]
    write_doc(pipeline, tp_rows, memory, "bash benchmarks/run.sh" + (f" --repeat {repeat}" if repeat != 10 else ""),
              seconds)
    print(f"rewrote docs/benchmarks.md and plots/pipeline_memory.png ({seconds or 0:.0f} s)")


if __name__ == "__main__":
    main()
