"""Step time of each program before and after a change, in paired rounds: the same command run from an
older checkout (--before DIR, e.g. `git worktree add /tmp/before <commit>`) and from this one, in turn,
so that a drift of the machine's speed hits both alike; each round's ratio after/before, then their
median. Issue 35's hot path (no read in the step, foreach norm, bucketed all-reduces) is measured so.

    git worktree add /tmp/before cdef9ee
    python benchmarks/hot_path.py --before /tmp/before --rounds 5 --out logs/bench/hot_path.json

A run's step time is the median of its logged steps after the first (mp.loop's median_step_time_s).
On this 2-core machine several ranks share two cores, so a ratio says what one change does under
the same oversubscription, not what a GPU would see (docs/gpu.md).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mp.flags import OneLineParser  # noqa: E402

COMMON = ["--data", "synthetic", "--eval-every", "0", "--threads", "1", "--steps", "30"]
MLP = ["--model", "mlp", "--layers", "6", "--hidden", "1024", "--batch-size", "64"]
CASES = {   # name: program, ranks, flags
    "baseline mlp": ("single_baseline.py", 1, MLP),
    "pipeline 1f1b mlp p2 m4": ("pipeline_microbatch.py", 2, MLP + ["--schedule", "1f1b", "--microbatches", "4"]),
    "joint dp2 pp2 1f1b mlp m4": ("pipeline_dp_joint.py", 4, MLP + ["--dp", "2", "--schedule", "1f1b",
                                                                   "--microbatches", "4"]),
    "tp2 mlp": ("tensor_parallel.py", 2, MLP),
    "3d dp2 tp2 cnn m2": ("parallel_3d.py", 4, ["--dp", "2", "--tp", "2", "--microbatches", "2", "--batch-size", "32"]),
}


def step_time(root, program, nproc, flags, folder):
    log = os.path.join(folder, "log.jsonl")
    cmd = [sys.executable, os.path.join(root, program)] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--",
        os.path.join(root, program)]
    proc = subprocess.run(cmd + COMMON + flags + ["--log-file", log], cwd=root, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    if proc.returncode:
        sys.exit(f"error: {program} in {root} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    with open(log) as f:
        summary = [json.loads(line) for line in f if '"summary"' in line][0]
    return summary["median_step_time_s"]


def main():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="a checkout of the code to compare with (git worktree add)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    p.add_argument("--out", default=None, help="write the rows here as JSON")
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.cases.split(","):
            program, nproc, flags = CASES[name]
            pairs = []
            for i in range(args.rounds):
                # who goes first alternates, so that a machine warming up or slowing down hits both alike
                order = (0, 1) if i % 2 == 0 else (1, 0)
                times = {k: step_time((args.before, ROOT)[k], program, nproc, flags, folder) for k in order}
                pairs.append((times[0], times[1]))
            ratios = [a / b for b, a in pairs]
            rows[name] = {"before_ms": 1e3 * statistics.median(b for b, _ in pairs),
                          "after_ms": 1e3 * statistics.median(a for _, a in pairs),
                          "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
            r = rows[name]
            print(f"{name:28s} before {r['before_ms']:7.1f} ms  after {r['after_ms']:7.1f} ms  after/before "
                  f"{r['ratio_median']:.2f} (rounds {r['ratio_min']:.2f}-{r['ratio_max']:.2f})", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rounds": args.rounds, "load": open("/proc/loadavg").read().split()[:3], "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
