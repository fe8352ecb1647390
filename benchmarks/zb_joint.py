"""zb against 1f1b in pipeline_dp_joint.py, in paired rounds: under data parallelism the buckets put
no hook on the weights zb's W writes, so W adds dA into the bucket's view in place (issue 42); before,
a hook on every parameter sent every W through autograd. Each round runs 1f1b and zb in turn (who goes
first alternates) from this checkout, and with --before DIR from an older one too, and takes the
round's ratio zb / 1f1b; the medians are reported with the load average.

    git worktree add /tmp/before 1c88f73
    python benchmarks/zb_joint.py --before /tmp/before --rounds 5 --out logs/bench/zb_joint.json

On 2 cores the 4 ranks (2 pipelines x 2 stages) are oversubscribed: the ratio says what the schedule
does under the same load, not what 4 free cores would see.
"""
import argparse
import json
import os
import statistics
import tempfile

from hot_path import ROOT, step_time
from mp.flags import OneLineParser   # hot_path put the repository root on sys.path

FLAGS = ["--model", "mlp", "--layers", "8", "--hidden", "768", "--batch-size", "256", "--dp", "2",
         "--microbatches", "8", "--balance", "2,6"]


def loadavg():
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def main():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=None, help="an older checkout to measure beside this one")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="write the rounds and medians here as JSON")
    args = p.parse_args()
    roots = {"now": ROOT, **({"before": args.before} if args.before else {})}
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.rounds):
            times, load = {}, loadavg()
            for name, root in (roots.items() if i % 2 == 0 else reversed(roots.items())):
                for schedule in (("1f1b", "zb") if i % 2 == 0 else ("zb", "1f1b")):
                    times[f"{name} {schedule}"] = step_time(root, "pipeline_dp_joint.py", 4,
                                                            FLAGS + ["--schedule", schedule], folder)
            rounds.append({"times_s": times, "load": load})
            print(f"round {i}: " + "  ".join(f"{k} {1e3 * v:.1f} ms" for k, v in times.items())
                  + f"  (load {load[0]:.2f})", flush=True)
    result = {"flags": FLAGS, "rounds": rounds, "cpu_count": os.cpu_count()}
    for name in roots:
        ratios = [r["times_s"][f"{name} zb"] / r["times_s"][f"{name} 1f1b"] for r in rounds]
        result[f"{name} zb/1f1b"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        print(f"{name}: zb / 1f1b median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
