"""zb and 2bw against 1f1b, and the cost of --recompute: measured bubble, step time and the F/B/W
time split of pipeline_microbatch.py itself on 2 stages of a compute-heavy mlp, split as evenly as
it cuts (2 processes on 2 cores: the schedule is measured, not the oversubscription); --stages 4
runs 4 stages of a 16-layer mlp (4 processes on 2 cores: oversubscribed, say so when quoting).

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
MLP4 = ["--model", "mlp", "--layers", "16", "--hidden", "1024", "--balance", "3,5,4,4", "--batch-size", "192",
        "--data", "synthetic", "--eval-every", "0", "--threads", "1"]
CONFIGS = {"1f1b": ["--schedule", "1f1b"], "zb": ["--schedule", "zb"], "2bw": ["--schedule", "2bw"],
           "1f1b --recompute": ["--schedule", "1f1b", "--recompute"]}


def run_once(args, folder, stages=2):
    log, trace = os.path.join(folder, "log.jsonl"), os.path.join(folder, "trace.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}", "--",
           os.path.join(ROOT, "pipeline_microbatch.py"), *args, "--log-file", log, "--timeline", trace]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"error: pipeline_microbatch.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        times = [json.loads(line)["step_time_s"] for line in f if '"train"' in line]
    with open(trace) as f:
        trace = json.load(f)
    other = trace["otherData"]
    return statistics.median(times[1:]), other["bubble_measured"], other["bubble_theory"], split_ms(trace)


def split_ms(trace):
    """{stage: {F, B, W, R: milliseconds per step}}: where each stage's compute goes (W: zb's
    weight gradients, R: --recompute's forwards), from the recorded step(s)."""
    steps = trace["otherData"].get("steps", 1)
    kinds = {"forward": "F", "backward": "B", "weight": "W", "recompute": "R"}
    out = {}
    for e in trace["traceEvents"]:
        if e.get("cat") in kinds:
            stage = out.setdefault(str(e["pid"]), {})
            stage[kinds[e["cat"]]] = stage.get(kinds[e["cat"]], 0) + e["dur"] / 1000 / steps
    return {stage: {k: round(v, 2) for k, v in kinds_ms.items()} for stage, kinds_ms in sorted(out.items())}


def measure(microbatches, rounds, steps, stages=2, configs=CONFIGS):
    rows = []
    model = MLP if stages == 2 else MLP4
    with tempfile.TemporaryDirectory() as folder:
        for m in microbatches:
            runs = {name: [] for name in configs}
            for _ in range(rounds):
                for name, flags in configs.items():
                    runs[name].append(run_once(model + flags + ["--microbatches", str(m), "--steps", str(steps)],
                                               folder, stages))
            for name, results in runs.items():
                ratio = [r[0] / b[0] for r, b in zip(results, runs["1f1b"])]
                rows.append({"config": name, "stages": stages, "microbatches": m,
                             "step_s": statistics.median(r[0] for r in results),
                             "split_ms": results[len(results) // 2][3],
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
    p.add_argument("--stages", default="2,4",
                   help="2 and/or 4; 4: 1f1b and 2bw only, on a 16-layer mlp (4 processes on this machine's cores), "
                        "at the microbatch counts >= 4")
    args = p.parse_args()
    rows = []
    for stages in (int(s) for s in args.stages.split(",")):
        configs = CONFIGS if stages == 2 else {k: CONFIGS[k] for k in ("1f1b", "2bw")}
        ms = [m for m in (int(m) for m in args.microbatches.split(",")) if m >= stages]   # 2bw: m >= p
        rows += measure(ms, args.rounds, args.steps, stages, configs)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "model": MLP, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
