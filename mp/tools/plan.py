"""python -m mp.tools.plan: what a layout costs before it is launched (docs/planning.md).

Two questions, one tool:

  this project's run, exactly (--program NAME and the program's own flags): the summary record's per-rank
  param_mb, grad_mb, optimizer_state_mb and the bytes each group sends a step, as a run would log them
      python -m mp.tools.plan --program pipeline_dp_joint --gpus 4 --model vit --dp 2 --zero 2 --json
  with the vit on pipeline_microbatch, pipeline_dp_joint, context_parallel or expert_parallel, also each rank's
  peak memory above its process floor (peak_above_floor_mb, with its parts); --this-machine adds the step time
  on this machine (step_s), from rates measured once and kept in ~/.cache/mp/this_machine.json: a real block's
  forward and backward on one thread, and gloo's messages and bytes between --gpus processes on these cores
  (--remeasure measures again; it ranks layouts, docs/planning.md says how well)

  any model on any cluster (a preset or the model flags, a cluster, a layout): memory of the largest rank, bytes
  per group, step time, tokens/s and TFLOP/s per GPU, MFU; --search ranks every layout that fits
      python -m mp.tools.plan --preset llama3-405b --gpus 16384 --gpu h100 --tp 8 --pp 16 --dp 128 --global-batch 2048
      python -m mp.tools.plan --preset llama3-70b --gpus 1024 --gpu h100 --global-batch 1024 --search

No torch: it plans on any machine. Bad input is one `error:` line and exit status 2.
"""
import argparse
import json
import os
import sys

from mp.cli import PARSERS
from mp.errors import fail
from mp.flags import OneLineParser
from mp.plan.cluster import GPUS, cluster
from mp.plan.machine import step_seconds, this_machine
from mp.plan.model import PRESETS, Model
from mp.plan.predict import Layout, memory, plan
from mp.plan.peak import PEAK_PROGRAMS, peak_above_floor
from mp.plan.project import counts
from mp.plan.search import legal, search, why
from mp.sizes import vit_tokens


def planner_parser():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--program", choices=sorted(PARSERS), help="this project's program whose run to count exactly; "
                   "every other flag is the program's own")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shape")
    p.add_argument("--model", choices=["vit", "gpt"], default="gpt")
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 4), ("kv-heads", None), ("seq-len", 64),
                          ("patch-size", 4), ("vocab", 256), ("experts", 0), ("top-k", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--ffn-mult", type=float, default=2.0, help="the feed-forward width over the hidden (here: 2)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    for name in ("peak-tflops", "memory-gb", "intra-gbps", "inter-gbps"):
        p.add_argument(f"--{name}", type=float, default=None)
    for name in ("dp", "tp", "pp", "cp", "ep"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=1)
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb", "zbv"], default="1f1b")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--microbatch-size", type=int, default=1, help="sequences in one microbatch")
    p.add_argument("--global-batch", type=int, default=512, help="sequences in one optimizer step")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--search", action="store_true", help="rank every legal layout that fits, best first")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="--program: whose collectives the bytes count (gloo's reduce-scatter is an all-reduce)")
    return p


def project_counts(argv):
    """--program NAME [--gpus N] [--json] and the program's own flags: its parser checks them as each rank would."""
    p = OneLineParser(add_help=False)
    p.add_argument("--program", required=True)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--this-machine", action="store_true")
    p.add_argument("--remeasure", action="store_true")
    own, rest = p.parse_known_args(argv)
    if own.program not in PARSERS:
        fail(f"--program {own.program}: choose one of {', '.join(sorted(PARSERS))}")
    os.environ["WORLD_SIZE"] = str(own.gpus)       # what torchrun would give each rank: the parser's checks read it
    args = PARSERS[own.program](rest + ["--data", "synthetic"], f"{own.program}.py")
    fields = counts(own.program, args, own.gpus, own.backend)
    if own.program in PEAK_PROGRAMS and args.model == "vit":   # the peak model covers these (docs/planning.md)
        peaks = peak_above_floor(own.program, args, own.gpus)
        fields["peak_above_floor_mb"] = {r: v["peak_above_floor_mb"] for r, v in peaks.items()}
        fields["peak_parts_mb"] = {r: v["parts_mb"] for r, v in peaks.items()}
    if own.this_machine or own.remeasure:   # the rates measured here once (mp/plan/machine.py says where kept)
        rates = this_machine(own.remeasure, own.gpus)
        fields["this_machine"] = rates
        fields["step_s"] = round(step_seconds(own.program, args, own.gpus, rates), 4)
    if own.json:
        print(json.dumps(fields))
        return
    print(f"{own.program}.py on {own.gpus} ranks: what each rank holds between steps and sends a step (MB)")
    for name in ("param_mb", "grad_mb", "optimizer_state_mb", "dp_sent_mb_per_step", "all_to_all_mb_per_step"):
        if name in fields:
            print(f"  {name:<24} " + "  ".join(f"{r}: {v:g}" for r, v in fields[name].items()))
    for group, ranks in fields["sent_mb_per_step"].items():
        print(f"  sent over {group:<14} " + "  ".join(f"{r}: {v:g}" for r, v in ranks.items()))
    if "step_s" in fields:
        rates = fields["this_machine"]
        gloo = rates["gloo"][str(max(own.gpus, 2))]
        print(f"  step time here {fields['step_s']:.3f} s (a block {rates['block_gflops']:g} GFLOP/s a thread, "
              f"GEMM {rates['gemm_gflops']:g}; gloo at {max(own.gpus, 2)} ranks {gloo['gbps']:g} GB/s, "
              f"{gloo['hop_s'] * 1e3:.2f} ms a message; {rates['cores']} cores, measured {rates['measured']})")
    for r, parts in fields.get("peak_parts_mb", {}).items():
        print(f"  peak above the floor, rank {r}: {fields['peak_above_floor_mb'][r]:g} MB (" +
              ", ".join(f"{k} {v:g}" for k, v in parts.items()) + ")")


def model_of(a):
    if a.preset:
        return PRESETS[a.preset]
    tokens = a.seq_len if a.model == "gpt" else vit_tokens(a.patch_size)
    return Model(a.model, a.layers, a.hidden, a.heads, a.kv_heads, int(a.ffn_mult * a.hidden), vocab=a.vocab,
                 tokens=tokens, experts=a.experts, top_k=a.top_k, patch=a.patch_size, name=a.model)


def layout_of(a, c):
    """The layout given; dp defaults to what the GPUs leave."""
    tp, pp, cp, ep = a.tp or 1, a.pp or 1, a.cp or 1, a.ep or 1
    dp = a.dp or max(1, c.gpus // (tp * pp * cp))
    return Layout(dp, tp, pp, cp, ep, a.zero, a.schedule, a.virtual_stages, a.microbatch_size, a.global_batch,
                  a.recompute, a.sequence_parallel, a.dtype)


def too_big(m, lay, c, r):
    """The error for a layout no rank can hold: by how much, and which axis would help most."""
    over = r["memory_gb"] - c.memory_gb
    parts = r["memory_parts_gb"]
    biggest = max(parts, key=parts.get)
    helps = {"weights": "pp or tp (or --zero 3)", "gradients": "pp or tp (or --zero 2)", "optimizer":
             "more dp x cp with --zero 1, or pp or tp", "activations": "tp with sequence parallelism, cp, or "
             "--recompute full", "buffers": "tp (the logits are vocabulary-parallel)"}[biggest]
    fail(f"{m.name or m.kind} needs {r['memory_gb']:.1f} GB on its largest rank at dp {lay.dp} tp {lay.tp} pp "
         f"{lay.pp} cp {lay.cp}, and a {c.name} holds {c.memory_gb:g} GB: {over:.1f} GB over; the largest part is "
         f"{biggest} ({parts[biggest]:.1f} GB): {helps} would help (or --search)")


def show(r):
    lay = r["layout"]
    print(f"{r['model']} on {r['gpus']} GPUs: dp {lay['dp']} tp {lay['tp']} pp {lay['pp']} cp {lay['cp']} ep "
          f"{lay['ep']}, zero {lay['zero']}, {lay['schedule']} v{lay['virtual_stages']}, recompute {lay['recompute']}, "
          f"microbatch {lay['microbatch']} of {lay['global_batch']}")
    print(f"  memory  {r['memory_gb']:.1f} GB on the largest rank: " +
          ", ".join(f"{k} {v:.1f}" for k, v in r["memory_parts_gb"].items()))
    print(f"  step    {r['step_s']:.3f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in r["time_parts_s"].items() if v))
    print(f"  rate    {r['tokens_per_s_per_gpu']:.0f} tokens/s a GPU, {r['model_tflops_per_gpu']:.0f} model and "
          f"{r['hardware_tflops_per_gpu']:.0f} hardware TFLOP/s a GPU, MFU {r['mfu']:.1%}")
    print("  bytes   a step per rank: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in r["bytes_per_step"].items()))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--program" or a.startswith("--program=") for a in argv):
        return project_counts(argv)
    a = planner_parser().parse_args(argv)
    m = model_of(a)
    c = cluster(a.gpus, a.gpu, a.gpus_per_node, peak_tflops=a.peak_tflops, memory_gb=a.memory_gb,
                intra_gbps=a.intra_gbps, inter_gbps=a.inter_gbps)
    base = layout_of(a, c)
    if a.search:
        return show_search(m, c, base, a.json)
    problem = legal(m, base, c)
    if problem:
        fail(problem)
    r = plan(m, base, c)
    if not r["fits"]:
        too_big(m, base, c, r)
    print(json.dumps(r)) if a.json else show(r)


def show_search(m, c, base, as_json):
    ranked, n = search(m, c, base)
    if not ranked:   # the model fits no rank of any layout: say by how much at the layout asked for
        parts, need = memory(m, base, c)
        fail(f"no layout of {m.name or m.kind} fits {c.gpus} {c.name}s of {c.memory_gb:g} GB ({n} legal layouts "
             f"tried; the one asked for needs {need / 1e9:.0f} GB a rank, most of it {max(parts, key=parts.get)}): "
             f"more GPUs, or a GPU with more memory")
    if as_json:
        print(json.dumps({"legal": n, "ranked": ranked, "why": why(*ranked[:2]) if len(ranked) > 1 else None}))
        return
    print(f"{n} legal layouts; the {len(ranked)} fastest that fit:")
    for i, r in enumerate(ranked):
        lay = r["layout"]
        print(f"  {i + 1:2d}. {r['step_s']:8.3f} s  {r['model_tflops_per_gpu']:5.0f} TFLOP/s  MFU {r['mfu']:5.1%}  "
              f"{r['memory_gb']:5.1f} GB  dp {lay['dp']} tp {lay['tp']} pp {lay['pp']} cp {lay['cp']} ep {lay['ep']} "
              f"zero {lay['zero']} {lay['schedule']} v{lay['virtual_stages']} rc {lay['recompute']} "
              f"mb {lay['microbatch']}")
    if len(ranked) > 1:
        print("why: " + why(ranked[0], ranked[1]))


if __name__ == "__main__":
    main()
