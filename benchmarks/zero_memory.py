"""ZeRO 0-3 side by side: what a data-parallel replica holds, what it sends, and its peak.

    python benchmarks/zero_memory.py                      # vit, 6 blocks of 256, D = 2 and 4, AdamW
    python benchmarks/zero_memory.py --model mlp --hidden 2048 --replicas 2   # weights larger than activations
    python benchmarks/zero_memory.py --hidden 64 --steps 2  # a quick look
    python benchmarks/zero_memory.py --model mlp --layers 8 --hidden 1024 --replicas 4 --microbatches 4 --rounds 3
                                                          # issue 58's configuration, 3 paired rounds

Runs pipeline_dp_joint.py as plain data parallelism (--dp equal to the world size: one stage, so N below
is the whole model) with --zero 0, 1, 2 and 3 (--zero3-gather step and microbatch), AdamW, and reads
each run's summary record: param_mb (weights held between steps), grad_mb (gradients held after the
update), optimizer_state_mb, dp_sent_mb_per_step (what a replica sent in its data-parallel collectives
per step, counted as a ring sends them), peak_param_mb (--zero 3: its slices plus the blocks gathered at
once) and peak_grad_mb (the gradient buckets and accumulators held at once). Beside each, the formula
for N MB of weights over D replicas and M microbatches. The last column is measured memory: the rank's
peak resident set above its floor, the same run with a tiny model (--hidden 8: the interpreter, torch,
gloo and the data), so what the model costs it at its peak: weights, gradients, state, activations (a
CPU process's peak cannot be reset, so it includes set-up, when the stage's whole weights are built),
with glibc's mmap threshold pinned so that memory freed is memory given back (docs/memory.md). Beside
rank 0's, the sum over the D ranks of their peaks above their floors, and that sum as a share of --zero
0's in the same round: --rounds R runs every configuration R times, round by round (each round pairs the
--zero values on the same machine load), and prints the table of each round. Prints markdown tables
(docs/optimizers.md quotes them).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from mp.flags import OneLineParser  # noqa: E402

CONFIGS = [("0", []), ("1", []), ("2", []), ("3 step", ["--zero3-gather", "step"]),
           ("3 microbatch", ["--zero3-gather", "microbatch"])]


def run(nproc, flags, log):
    cmd = [sys.executable, "-m", "mp.tools.torchrun", "--standalone", f"--nproc-per-node={nproc}", "--",
           os.path.join(ROOT, "pipeline_dp_joint.py")]
    # glibc's threshold pinned: a freed block of 128 kB or more goes back to the system at once, so the
    # peak resident set shows what is held together, not what the heap kept after an earlier free
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd + flags + ["--log-file", log], env=env, capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    if proc.returncode:
        sys.exit(f"error: pipeline_dp_joint.py {' '.join(flags)} failed: {proc.stderr[-2000:]}")
    with open(log) as f:
        return next(r for r in map(json.loads, f) if r["event"] == "summary")


def formula(zero, n, d, m):
    """(weights, gradients, AdamW state, sent per step) a replica holds and sends, in MB, for N MB of weights."""
    ring = (d - 1) / d * n                         # one half of an all-reduce of N: a reduce-scatter or an all-gather
    # --zero 2 and 3 reduce-scatter the gradients in every microbatch's backward: M halves, and the all-gather
    sent = {"0": 2 * ring, "1": 2 * ring, "2": ring * (m + 1), "3 step": ring * (m + 1), "3 microbatch": ring * 3 * m}
    weights = n / d if zero.startswith("3") else n
    grads = n if zero in ("0", "1") else n / d      # --zero 1 reduce-scatters into the buckets: no slices beside them
    state = 2 * n if zero == "0" else 2 * n / d
    return weights, grads, state, sent[zero]


def measure(args, tmp):
    common = ["--model", args.model, "--layers", str(args.layers), "--batch-size", "32", "--microbatches",
              str(args.microbatches), "--steps", str(args.steps), "--eval-every", "0", "--data", "synthetic",
              "--optimizer", "adamw"] + (["--heads", "4"] if args.model == "vit" else [])
    rows = []
    for d in args.replicas:
        for zero, extra in CONFIGS:
            flags = common + ["--dp", str(d), "--zero", zero.split()[0]] + extra
            big = run(d, flags + ["--hidden", str(args.hidden)], os.path.join(tmp, "big.jsonl"))
            tiny = run(d, flags + ["--hidden", "8"], os.path.join(tmp, "tiny.jsonl"))
            n = big["model_param_mb"]
            above = {r: big["peak_memory_mb"][r] - tiny["peak_memory_mb"][r] for r in big["peak_memory_mb"]}
            rows.append({"D": d, "zero": zero, "N": n, "formula": formula(zero, n, d, args.microbatches),
                         "measured": [big[k]["0"] for k in ("param_mb", "grad_mb", "optimizer_state_mb",
                                                             "dp_sent_mb_per_step")],
                         "peak_param_mb": big.get("peak_param_mb", {}).get("0"),
                         "peak_grad_mb": big.get("peak_grad_mb", {}).get("0"),
                         "above_floor_mb": above["0"], "summed_mb": sum(above.values())})
            print(f"D={d} --zero {zero}: done", file=sys.stderr, flush=True)
    return rows


def table(rows, m, args):
    lines = ["| D | --zero | weights held | gradients held | AdamW state | sent per step | weights at the peak "
             "| gradients at the peak | peak RSS above the floor | summed over the D ranks (of --zero 0's) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{got:.2f} ({want:.2f})" for got, want in zip(r["measured"], r["formula"])]
        peak = f"{r['peak_param_mb']:.2f}" if r["peak_param_mb"] is not None else f"{r['measured'][0]:.2f}"
        grads = f"{r['peak_grad_mb']:.2f}" if r["peak_grad_mb"] is not None else "-"
        plain = next(q for q in rows if q["D"] == r["D"] and q["zero"] == "0")["summed_mb"]
        lines.append(f"| {r['D']} | {r['zero']} | " + " | ".join(cells) + f" | {peak} | {grads} | "
                     f"{r['above_floor_mb']:.0f} | {r['summed_mb']:.0f} ({r['summed_mb'] / plain:.2f}) |")
    return "\n".join(lines) + (f"\n\nMB per rank (rank 0), measured (formula); N = {rows[0]['N']:.2f} MB of weights, "
                               f"M = {m} microbatches; {args.model}, {args.layers} layers of {args.hidden}.")


def main():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["vit", "mlp"], default="vit")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, round by round")
    p.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4],
                   help="the D values, comma-separated (each runs on D ranks)")
    args = p.parse_args()
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            if args.rounds > 1:
                print(f"\nround {round_ + 1} of {args.rounds}:\n", flush=True)
            print(table(measure(args, tmp), args.microbatches, args), flush=True)


if __name__ == "__main__":
    main()
