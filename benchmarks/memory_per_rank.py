"""Memory per rank: what each rank holds of the model (param_mb) and its peak above the process floor.

    python benchmarks/memory_per_rank.py                 # mlp 12 x 1536 (108 MB of weights), 3 steps
    python benchmarks/memory_per_rank.py --hidden 768    # a smaller model

Runs the baseline and four layouts with torchrun on synthetic data and reads each run's summary
record. The floor of a rank is the peak of the same program, layout and rank with a tiny model of
the same depth (--hidden 8): the interpreter, torch, gloo and the data, everything but the model. A
rank's peak above its floor is then what the model costs it: its parameters, their gradients and
momentum (3 x param_mb), the one full block being built (set-up), activations, and buffers. Prints
a markdown table (docs/memory.md quotes it).
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


LAYOUTS = [   # (name, program, ranks, extra flags)
    ("baseline", "single_baseline.py", 1, []),
    ("pipeline p = 4", "pipeline_microbatch.py", 4, []),
    ("tensor parallel t = 4", "tensor_parallel.py", 4, []),
    ("joint dp 2 x pp 2", "pipeline_dp_joint.py", 4, ["--dp", "2", "--microbatches", "4"]),
    ("3-D dp 2 x pp 1 x tp 2", "parallel_3d.py", 4, ["--dp", "2", "--tp", "2"]),
]


def run(program, nproc, flags, log):
    cmd = [sys.executable, os.path.join(ROOT, program)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--",
         os.path.join(ROOT, program)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd + flags + ["--log-file", log], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"error: {program} failed: {proc.stderr[-2000:]}")
    with open(log) as f:
        return next(r for r in map(json.loads, f) if r["event"] == "summary")


def measure(args, tmp):
    common = ["--model", "mlp", "--layers", str(args.layers), "--batch-size", "64", "--steps", str(args.steps),
              "--eval-every", "0", "--data", "synthetic"]
    rows = []
    for name, program, nproc, extra in LAYOUTS:
        big = run(program, nproc, common + ["--hidden", str(args.hidden)] + extra, os.path.join(tmp, "big.jsonl"))
        tiny = run(program, nproc, common + ["--hidden", "8"] + extra, os.path.join(tmp, "tiny.jsonl"))
        for rank in sorted(big["peak_memory_mb"], key=int):
            rows.append({"layout": name, "rank": int(rank), "param_mb": big.get("param_mb", {}).get(rank),
                         "model_param_mb": big.get("model_param_mb"),
                         "above_floor_mb": big["peak_memory_mb"][rank] - tiny["peak_memory_mb"][rank]})
    return rows


def table(rows):
    base = next(r for r in rows if r["layout"] == "baseline")
    lines = ["| layout | rank | param_mb (share of the model) | 3 x param_mb | peak above the floor | of the baseline's |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        held = "not logged | -" if r["param_mb"] is None else \
            f"{r['param_mb']:.1f} ({r['param_mb'] / r['model_param_mb']:.2f}) | {3 * r['param_mb']:.0f} MB"
        lines.append(f"| {r['layout']} | {r['rank']} | {held} | {r['above_floor_mb']:.0f} MB "
                     f"| {r['above_floor_mb'] / base['above_floor_mb']:.2f} |")
    return "\n".join(lines)


def main():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, tmp)
    print(f"mlp --layers {args.layers} --hidden {args.hidden}, batch 64, {args.steps} steps, "
          f"CPU peak RSS (MB, 2^20 bytes)\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
