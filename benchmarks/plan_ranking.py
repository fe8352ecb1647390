"""Does `python -m mp.tools.plan --this-machine` rank layouts as they run here? Six layouts' step times,
predicted and measured, and Spearman's rank correlation (issue 84 asks for at least 0.8 on the 2 cores).

    python benchmarks/plan_ranking.py               # 2 paired rounds: the layouts in order, then reversed
    python benchmarks/plan_ranking.py --rounds 4    # more rounds: the medians steadier on a busy machine

It measures this machine once (mp.plan.machine.this_machine, into a fresh cache), predicts each layout's
step (step_seconds), then runs the layouts with torchrun on synthetic data, round by round, each round in the
other order than the last, so that a load that rises or falls during the rounds weighs on every layout alike;
a layout's time is the median of its steps after the first two, over the rounds. A timing, not a test: on
shared cores one layout's step moved up to 2x between runs minutes apart (docs/planning.md), so the suite
checks what --this-machine computes and this script, run by hand, what it predicts.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mp.cli import PARSERS  # noqa: E402
from mp.flags import OneLineParser  # noqa: E402
from mp.plan.machine import step_seconds, this_machine  # noqa: E402

MODEL = ["--model", "vit", "--hidden", "256", "--layers", "4", "--heads", "4", "--batch-size", "32"]
FAST = ["--data", "synthetic", "--eval-every", "0", "--threads", "1"]
LAYOUTS = {"1f1b m8": ("pipeline_microbatch", 4, "--microbatches 8 --schedule 1f1b"),
           "dp 4": ("pipeline_dp_joint", 4, "--dp 4 --microbatches 1"),
           "baseline": ("single_baseline", 1, ""),
           "tp 4": ("tensor_parallel", 4, ""),
           "dp 4 zero 3 m4": ("pipeline_dp_joint", 4, "--dp 4 --microbatches 4 --zero 3 --zero3-gather microbatch"),
           "dp 4 zero 3 m8": ("pipeline_dp_joint", 4, "--dp 4 --microbatches 8 --zero 3 --zero3-gather microbatch")}


def ranks_of(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    return [order.index(i) for i in range(len(values))]


def spearman(xs, ys):
    """Rank correlation of two lists without ties: 1 - 6 sum d^2 / (n (n^2 - 1))."""
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(ranks_of(xs), ranks_of(ys))) / (n * (n * n - 1))


def step_times(program, world, flags, steps, log):
    """The step times after the first two (allocations, gloo's first connections) of one run."""
    cmd = [sys.executable, os.path.join(ROOT, f"{program}.py")] if world == 1 else \
        [sys.executable, "-m", "mp.tools.torchrun", "--standalone", f"--nproc-per-node={world}", "--",
         os.path.join(ROOT, f"{program}.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)             # set here for the parsers only: the runs take theirs from torchrun
    proc = subprocess.run(cmd + MODEL + FAST + flags.split() + ["--steps", str(steps), "--log-file", log],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"error: {program} {flags} failed with exit status {proc.returncode}:\n{proc.stderr[-2000:]}")
    with open(log) as f:
        return [r["step_time_s"] for r in map(json.loads, f) if r["event"] == "train" and r["step"] >= 2]


def main(argv=None):
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds, alternately in order and reversed")
    parser.add_argument("--steps", type=int, default=5, help="steps a run (the first two are not timed)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 3:
        parser.error(f"--rounds {args.rounds} and --steps {args.steps}: need at least 1 round and 3 steps")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")   # measured afresh, the user's cache untouched
        rates = this_machine(world=4)
        predicted = {}
        for name, (program, world, flags) in LAYOUTS.items():
            os.environ["WORLD_SIZE"] = str(world)
            predicted[name] = step_seconds(program, PARSERS[program](MODEL + FAST + flags.split(), program), world,
                                           rates)
        times = {name: [] for name in LAYOUTS}
        for r in range(args.rounds):
            order = list(LAYOUTS) if r % 2 == 0 else list(LAYOUTS)[::-1]
            for name in order:
                print(f"round {r + 1} of {args.rounds}: {name}", flush=True)
                log = os.path.join(tmp, f"{r}-{order.index(name)}.jsonl")
                times[name] += step_times(*LAYOUTS[name], args.steps, log)
    measured = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    rho = spearman([predicted[n] for n in LAYOUTS], [measured[n] for n in LAYOUTS])
    print(f"\n--this-machine: {rates}\n\n| layout | predicted s | measured s (median of {args.rounds} rounds) |")
    print("| --- | --- | --- |")
    for name in LAYOUTS:
        print(f"| {name} | {predicted[name]:.3f} | {measured[name]:.3f} |")
    print(f"\nSpearman {rho:.3f} (issue 84's bar: 0.8)")


if __name__ == "__main__":
    main()
