"""zb against 1f1b, and the cost of --recompute: measured bubble and step time of
pipeline_microbatch.py itself on 2 stages of a compute-heavy mlp, split as evenly as it cuts
(2 processes on 2 cores: the schedule is measured, not the oversubscription).

    python benchmarks/zero_bubble.py --out logs/bench/zero_bubble.json     # about 4 minutes on 2 cores

Each configuration runs `--rounds` times, the configurations of one microbatch count in turn
(1f1b, zb, 1f1b --recompute, ...), so a drift of the machine's speed hits all alike; a run's step
time is the median of its steps after the first, its bubble is that of its last step's timeline
(1 - compute time / (stages x span)). Ratios are taken round by round, then their median.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --balance 3,5: the first Linear (3072 x 1024) has 3 times the multiply-adds of each other one
MLP = ["--model", "mlp", "--layers", "8", "--hidden", "1024", "--balance", "3,5", "--batch-size", "192",
       "--data", "synthetic", "--eval-every", "0", "--threads", "1"]
CONFIGS = {"1f1b": ["--schedule", "1f1b"], "zb": ["--schedule", "zb"],
           "1f1b --recompute": ["--schedule", "1f1b", "--recompute"]}


def run_once(args, folder):
    log, trace = os.path.join(folder, "log.jsonl"), os.path.join(folder, "trace.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--",
           os.path.join(ROOT, "pipeline_microbatch.py"), *args, "--log-file", log, "--timeline", trace]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"error: pipeline_microbatch.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        times = [json.loads(line)["step_time_s"] for line in f if '"train"' in line]
    with open(trace) as f:
        other = json.load(f)["otherData"]
    return statistics.median(times[1:]), other["bubble_measured"], other["bubble_theory"]


def measure(microbatches, rounds, steps):
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for m in microbatches:
            runs = {name: [] for name in CONFIGS}
            for _ in range(rounds):
                for name, flags in CONFIGS.items():
                    runs[name].append(run_once(MLP + flags + ["--microbatches", str(m), "--steps", str(steps)],
                                               folder))
            for name, results in runs.items():
                ratio = [r[0] / b[0] for r, b in zip(results, runs["1f1b"])]
                rows.append({"config": name, "microbatches": m,
                             "step_s": statistics.median(r[0] for r in results),
                             "bubble_measured": statistics.median(r[1] for r in results),
                             "bubble_theory": results[0][2], "over_1f1b": statistics.median(ratio)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "logs", "bench", "zero_bubble.json"))
    p.add_argument("--microbatches", default="4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    rows = measure([int(m) for m in args.microbatches.split(",")], args.rounds, args.steps)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "model": MLP, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
