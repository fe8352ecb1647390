"""The planner (python -m mp.tools.plan, mp/plan/): exact against this project's runs, within 15% of the field's
published ones, and one error line for bad input. Fast: everything in-process and without launching, except
the few real launches marked slow (each compares every field of a fresh run's summary)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from helpers import FAST, ROOT, launch
from mp.buckets import kept_groups as real_kept_groups
from mp.cli import PARSERS
from mp.dist import buckets as real_buckets
from mp.plan.cluster import cluster
from mp.plan.machine import step_seconds, this_machine
from mp.plan.model import PRESETS, megatron_gpt, with_tokens
from mp.plan.peak import peak_above_floor
from mp.plan.predict import EFFICIENCY, Layout, plan
from mp.plan.buckets import capped_groups, kept_groups
from mp.plan.project import counts
from mp.plan.search import search

SMALL = ["--model", "vit", "--hidden", "32", "--layers", "2", "--heads", "2"]

# Summary records of real runs (2 steps, gloo on 2 CPU cores, 2026-12-07), with SMALL + FAST + --steps 2: the
# program, the world size, its flags, and what its summary logged
MEASURED = {'cp_ring': ('context_parallel', 2, '--batch-size 8',
             {'grad_mb': {'0': 0.0805, '1': 0.0805},
              'optimizer_state_mb': {'0': 0.0805, '1': 0.0805},
              'param_mb': {'0': 0.0805, '1': 0.0805},
              'sent_mb_per_step': {'cp': {'0': 0.5802, '1': 0.5802}}}),
 'cp_uly': ('context_parallel', 2, '--batch-size 8 --attention ulysses',
            {'grad_mb': {'0': 0.0805, '1': 0.0805},
             'optimizer_state_mb': {'0': 0.0805, '1': 0.0805},
             'param_mb': {'0': 0.0805, '1': 0.0805},
             'sent_mb_per_step': {'cp': {'0': 0.3302, '1': 0.3302}}}),
 'ep2': ('expert_parallel', 2, '--batch-size 8 --experts 4 --top-k 2',
         {'all_to_all_mb_per_step': {'0': 0.251099, '1': 0.251099},
          'grad_mb': {'0': 0.1134, '1': 0.1134},
          'optimizer_state_mb': {'0': 0.1134, '1': 0.1134},
          'param_mb': {'0': 0.1134, '1': 0.1134},
          'sent_mb_per_step': {'ep': {'0': 0.300697, '1': 0.300697}}}),
 'j_z1': ('pipeline_dp_joint', 4, '--dp 2 --batch-size 24 --microbatches 3 --zero 1 --optimizer adamw',
          {'dp_sent_mb_per_step': {'0': 0.0464, '1': 0.0341, '2': 0.0464, '3': 0.0341},
           'grad_mb': {'0': 0.0464, '1': 0.0341, '2': 0.0464, '3': 0.0341},
           'optimizer_state_mb': {'0': 0.0464, '1': 0.0341, '2': 0.0464, '3': 0.0341},
           'param_mb': {'0': 0.0464, '1': 0.0341, '2': 0.0464, '3': 0.0341},
           'sent_mb_per_step': {'dp': {'0': 0.06958, '1': 0.051144, '2': 0.06958, '3': 0.051144},
                                'pp': {'0': 0.09375, '1': 0.09375, '2': 0.09375, '3': 0.09375}}}),
 'j_z3': ('pipeline_dp_joint', 4, '--dp 2 --batch-size 24 --microbatches 3 --zero 3',
          {'dp_sent_mb_per_step': {'0': 0.0928, '1': 0.0682, '2': 0.0928, '3': 0.0682},
           'grad_mb': {'0': 0.0232, '1': 0.017, '2': 0.0232, '3': 0.017},
           'optimizer_state_mb': {'0': 0.0232, '1': 0.017, '2': 0.0232, '3': 0.017},
           'param_mb': {'0': 0.0232, '1': 0.017, '2': 0.0232, '3': 0.017},
           'sent_mb_per_step': {'dp': {'0': 0.162354, '1': 0.119335, '2': 0.162354, '3': 0.119335},
                                'pp': {'0': 0.09375, '1': 0.09375, '2': 0.09375, '3': 0.09375}}}),
 'p3d': ('parallel_3d', 8, '--dp 2 --tp 2 --batch-size 16 --microbatches 2',
         {'dp_sent_mb_per_step': {'0': 0.0305,
                                  '1': 0.0305,
                                  '2': 0.0182,
                                  '3': 0.0182,
                                  '4': 0.0305,
                                  '5': 0.0305,
                                  '6': 0.0182,
                                  '7': 0.0182},
          'grad_mb': {'0': 0.0305,
                      '1': 0.0305,
                      '2': 0.0182,
                      '3': 0.0182,
                      '4': 0.0305,
                      '5': 0.0305,
                      '6': 0.0182,
                      '7': 0.0182},
          'optimizer_state_mb': {'0': 0.0305,
                                 '1': 0.0305,
                                 '2': 0.0182,
                                 '3': 0.0182,
                                 '4': 0.0305,
                                 '5': 0.0305,
                                 '6': 0.0182,
                                 '7': 0.0182},
          'param_mb': {'0': 0.0305,
                       '1': 0.0305,
                       '2': 0.0182,
                       '3': 0.0182,
                       '4': 0.0305,
                       '5': 0.0305,
                       '6': 0.0182,
                       '7': 0.0182},
          'sent_mb_per_step': {'dp': {'0': 0.030457,
                                      '1': 0.030457,
                                      '2': 0.018166,
                                      '3': 0.018166,
                                      '4': 0.030457,
                                      '5': 0.030457,
                                      '6': 0.018166,
                                      '7': 0.018166},
                               'pp': {'0': 0.03125,
                                      '1': 0.03125,
                                      '2': 0.03125,
                                      '3': 0.03125,
                                      '4': 0.03125,
                                      '5': 0.03125,
                                      '6': 0.03125,
                                      '7': 0.03125},
                               'tp': {'0': 0.28125,
                                      '1': 0.28125,
                                      '2': 0.28125,
                                      '3': 0.28125,
                                      '4': 0.28125,
                                      '5': 0.28125,
                                      '6': 0.28125,
                                      '7': 0.28125}}}),
 'p5d_ep': ('parallel_5d', 4, '--dp 2 --ep 2 --experts 4 --batch-size 16 --microbatches 2',
            {'all_to_all_mb_per_step': {'0': 0.12854, '1': 0.127563, '2': 0.12854, '3': 0.127563},
             'dp_sent_mb_per_step': {'0': 0.0309, '1': 0.0186, '2': 0.0309, '3': 0.0186},
             'grad_mb': {'0': 0.0629, '1': 0.0506, '2': 0.0629, '3': 0.0506},
             'optimizer_state_mb': {'0': 0.0629, '1': 0.0506, '2': 0.0629, '3': 0.0506},
             'param_mb': {'0': 0.0629, '1': 0.0506, '2': 0.0629, '3': 0.0506},
             'sent_mb_per_step': {'dp_cp': {'0': 0.031132, '1': 0.018841, '2': 0.031132, '3': 0.018841},
                                  'ep': {'0': 0.12854, '1': 0.127563, '2': 0.12854, '3': 0.127563},
                                  'pp': {'0': 0.062504, '1': 0.062504, '2': 0.062504, '3': 0.062504},
                                  'tp': {'0': 0.0, '1': 0.0, '2': 0.0, '3': 0.0}}}),
 'tp2sp': ('tensor_parallel', 2, '--batch-size 8 --sequence-parallel',
           {'grad_mb': {'0': 0.0486, '1': 0.0486},
            'optimizer_state_mb': {'0': 0.0486, '1': 0.0486},
            'param_mb': {'0': 0.0486, '1': 0.0486},
            'sent_mb_per_step': {'tp': {'0': 0.516479, '1': 0.516479}}})}

MEASURED['p5d_cp'] = ('parallel_5d', 8, '--dp 1 --cp 2 --tp 2 --batch-size 8 --microbatches 2 --schedule 1f1b',
     {'all_to_all_mb_per_step': {'0': 0.0,
                                 '1': 0.0,
                                 '2': 0.0,
                                 '3': 0.0,
                                 '4': 0.0,
                                 '5': 0.0,
                                 '6': 0.0,
                                 '7': 0.0},
      'dp_sent_mb_per_step': {'0': 0.0305,
                              '1': 0.0305,
                              '2': 0.0305,
                              '3': 0.0305,
                              '4': 0.0182,
                              '5': 0.0182,
                              '6': 0.0182,
                              '7': 0.0182},
      'grad_mb': {'0': 0.0305,
                  '1': 0.0305,
                  '2': 0.0305,
                  '3': 0.0305,
                  '4': 0.0182,
                  '5': 0.0182,
                  '6': 0.0182,
                  '7': 0.0182},
      'optimizer_state_mb': {'0': 0.0305,
                             '1': 0.0305,
                             '2': 0.0305,
                             '3': 0.0305,
                             '4': 0.0182,
                             '5': 0.0182,
                             '6': 0.0182,
                             '7': 0.0182},
      'param_mb': {'0': 0.0305,
                   '1': 0.0305,
                   '2': 0.0305,
                   '3': 0.0305,
                   '4': 0.0182,
                   '5': 0.0182,
                   '6': 0.0182,
                   '7': 0.0182},
      'sent_mb_per_step': {'cp': {'0': 0.125,
                                  '1': 0.125,
                                  '2': 0.125,
                                  '3': 0.125,
                                  '4': 0.125977,
                                  '5': 0.125977,
                                  '6': 0.125977,
                                  '7': 0.125977},
                           'dp_cp': {'0': 0.030457,
                                     '1': 0.030457,
                                     '2': 0.030457,
                                     '3': 0.030457,
                                     '4': 0.018166,
                                     '5': 0.018166,
                                     '6': 0.018166,
                                     '7': 0.018166},
                           'pp': {'0': 0.015625,
                                  '1': 0.015625,
                                  '2': 0.015625,
                                  '3': 0.015625,
                                  '4': 0.015625,
                                  '5': 0.015625,
                                  '6': 0.015625,
                                  '7': 0.015625},
                           'tp': {'0': 0.140625,
                                  '1': 0.140625,
                                  '2': 0.140625,
                                  '3': 0.140625,
                                  '4': 0.140625,
                                  '5': 0.140625,
                                  '6': 0.140625,
                                  '7': 0.140625}}})
MEASURED['pm_il'] = ('pipeline_microbatch', 4, '--batch-size 16 --microbatches 4 --schedule interleaved --layers 6',
     {'grad_mb': {'0': 0.0464, '1': 0.0652, '2': 0.0652, '3': 0.0341},
      'optimizer_state_mb': {'0': 0.0464, '1': 0.0652, '2': 0.0652, '3': 0.0341},
      'param_mb': {'0': 0.0464, '1': 0.0652, '2': 0.0652, '3': 0.0341},
      'sent_mb_per_step': {'pp': {'0': 0.375, '1': 0.5, '2': 0.5, '3': 0.375}}})
MEASURED['j_z2'] = ('pipeline_dp_joint', 4, '--dp 2 --batch-size 24 --microbatches 3 --zero 2',
     {'dp_sent_mb_per_step': {'0': 0.0928, '1': 0.0682, '2': 0.0928, '3': 0.0682},
      'grad_mb': {'0': 0.0232, '1': 0.017, '2': 0.0232, '3': 0.017},
      'optimizer_state_mb': {'0': 0.0232, '1': 0.017, '2': 0.0232, '3': 0.017},
      'param_mb': {'0': 0.0464, '1': 0.0341, '2': 0.0464, '3': 0.0341},
      'sent_mb_per_step': {'dp': {'0': 0.162354, '1': 0.119335, '2': 0.162354, '3': 0.119335},
                           'pp': {'0': 0.09375, '1': 0.09375, '2': 0.09375, '3': 0.09375}}})
MEASURED['tp2'] = ('tensor_parallel', 2, '--batch-size 8',
     {'grad_mb': {'0': 0.0486, '1': 0.0486},
      'optimizer_state_mb': {'0': 0.0486, '1': 0.0486},
      'param_mb': {'0': 0.0486, '1': 0.0486},
      'sent_mb_per_step': {'tp': {'0': 0.5, '1': 0.5}}})

ROUTED = ("all_to_all_mb_per_step",)   # the experts' all-to-all: data-dependent (the learned route)


def planned(program, world, flags, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = PARSERS[program](SMALL + FAST + ["--steps", "2"] + flags.split(), program)
    return counts(program, args, world)


def assert_same(predicted, measured):
    """Every field equal, as the summary rounds it; the experts' all-to-all (and the ep group's bytes, which hold
    it) within 5% of the even route's expectation; a group the run names with 0 bytes may be absent here."""
    for name, value in measured.items():
        if name in ROUTED:
            for r, v in value.items():   # a dense parallel_5d run logs 0 here: the planner has no field
                assert predicted.get(name, {}).get(r, 0) == pytest.approx(v, rel=0.05), (name, r)
            continue
        if name == "sent_mb_per_step":
            for group, ranks in value.items():
                for r, v in ranks.items():
                    mine = predicted[name].get(group, {}).get(r, 0)
                    if group == "ep" and v:
                        assert mine == pytest.approx(v, rel=0.05), (group, r)
                    else:
                        assert mine == v, (group, r, mine, v)
            continue
        assert predicted[name] == value, name


@pytest.mark.parametrize("run", sorted(MEASURED))
def test_counts_equal_recorded_summaries(run, monkeypatch):
    program, world, flags, measured = MEASURED[run]
    assert_same(planned(program, world, flags, monkeypatch), measured)


# fresh runs of layouts the records above do not hold (zbv's V placement, gpipe with recompute, adamw at zero 0)
LAUNCHED = [("pipeline_microbatch", 2, "--batch-size 8 --microbatches 4 --schedule zbv --layers 4"),
            ("parallel_3d", 4, "--dp 1 --tp 2 --batch-size 8 --microbatches 2 --recompute --optimizer adamw")]


@pytest.mark.slow
@pytest.mark.parametrize("program,world,flags", LAUNCHED, ids=[f"{p}-{w}" for p, w, _ in LAUNCHED])
def test_counts_equal_a_fresh_run(program, world, flags, tmp_path, monkeypatch):
    run = launch(f"{program}.py", SMALL + FAST + ["--steps", "2"] + flags.split(), tmp_path, nproc=world)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = run.events("summary")[0]
    measured = {k: summary[k] for k in ("param_mb", "grad_mb", "optimizer_state_mb", "dp_sent_mb_per_step",
                                        "sent_mb_per_step") if k in summary}
    assert_same(planned(program, world, flags, monkeypatch), measured)


def test_the_peak_replays_constants_mirror_the_package():
    """mp/plan/peak.py keeps the package's numbers without importing torch: they must stay the package's."""
    import mp.buckets
    import mp.plan.peak
    import mp.pp.p2p
    assert (mp.plan.peak.IN_FLIGHT, mp.plan.peak.EXCHANGES_AHEAD) == (mp.buckets.IN_FLIGHT, mp.pp.p2p.EXCHANGES_AHEAD)


def test_buckets_mirror_the_package():
    """The planner's bucket rules are mp.buckets.kept_groups and mp.dist.buckets, written on element counts."""
    sizes = [3, 1000, 40, 5000, 5000, 7, 300000, 20, 2000, 64, 1]
    tensors = [torch.zeros(n) for n in sizes]
    for nbytes in (400, 4096, 30000, 2**20):
        assert [[t.numel() for t in g] for g in real_kept_groups(tensors, nbytes)] == kept_groups(sizes, nbytes)
        assert [[t.numel() for t in g] for g in real_buckets(tensors, nbytes)] == capped_groups(sizes, nbytes)


# ----------------------------------------------------------------------------- the published runs

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021,
# Table 1 (weak scaling, A100 80GB, sequence 2048, vocab 51200, full activation recomputation): billions of
# parameters, heads, hidden, layers, tp, pp, GPUs, global batch, achieved TFLOP/s per GPU
MEGATRON = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
            (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
            (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
            (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
            (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
# Llama Team, "The Llama 3 Herd of Models", 2024, Table 4 (405B on H100s, TP 8, PP 16, 16M tokens a batch):
# GPUs, cp, dp, sequence, model TFLOP/s per GPU. The schedule is their interleaved 1F1B; v = 4 is our assumption
LLAMA = [(8192, 1, 64, 8192, 430), (16384, 1, 128, 8192, 400), (16384, 16, 8, 131072, 380)]
BAR = 0.15


def megatron_row(row):
    _, heads, hidden, layers, tp, pp, gpus, batch, published = row
    lay = Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, global_batch=batch, recompute="full", zero=0)
    return plan(megatron_gpt(layers, hidden, heads), lay, cluster(gpus, "a100"))["hardware_tflops_per_gpu"], published


def llama_row(row):
    gpus, cp, dp, seq, published = row
    lay = Layout(dp=dp, tp=8, pp=16, cp=cp, global_batch=16 * 2**20 // seq, schedule="interleaved", virtual_stages=4)
    return plan(with_tokens(PRESETS["llama3-405b"], seq), lay, cluster(gpus, "h100"))["model_tflops_per_gpu"], published


@pytest.mark.parametrize("row", MEGATRON, ids=[f"{r[0]}B" for r in MEGATRON])
def test_megatron_weak_scaling_within_15_percent(row):
    predicted, published = megatron_row(row)
    assert abs(predicted / published - 1) <= BAR, (predicted, published, EFFICIENCY)


@pytest.mark.parametrize("row", LLAMA, ids=[f"{r[0]}-cp{r[1]}" for r in LLAMA])
def test_llama3_405b_within_15_percent(row):
    predicted, published = llama_row(row)
    assert abs(predicted / published - 1) <= BAR, (predicted, published, EFFICIENCY)


def test_search_ranks_16384_gpus_in_seconds():
    start = time.perf_counter()
    ranked, legal = search(PRESETS["llama3-405b"], cluster(16384, "h100"), Layout(global_batch=2048))
    assert time.perf_counter() - start < 30 and legal > 100 and ranked
    assert [r["step_s"] for r in ranked] == sorted(r["step_s"] for r in ranked)
    assert all(r["fits"] for r in ranked)


# ----------------------------------------------------------------------------- the command line


def plan_cli(*argv):
    return subprocess.run([sys.executable, "-m", "mp.tools.plan", *argv], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def test_plans_without_torch():
    code = "import sys, mp.tools.plan, mp.plan.search; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_json_has_the_fields():
    out = plan_cli("--preset", "llama3-8b", "--gpus", "8", "--tp", "2", "--global-batch", "64", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for key in ("step_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu",
                "memory_gb", "memory_parts_gb", "bytes_per_step"):
        assert key in r
    assert 0 < r["mfu"] < 1


BAD = [(["--preset", "llama3-8b", "--gpus", "8", "--tp", "3"], "does not use the 8 GPUs"),
       (["--preset", "llama3-8b", "--gpus", "8", "--tp", "16", "--dp", "1"], "does not use"),
       (["--preset", "gpt3-175b", "--gpus", "128", "--tp", "128", "--dp", "1"], "does not divide the 96 heads"),
       (["--preset", "llama3-8b", "--gpus", "64", "--pp", "64", "--dp", "1"], "every chunk needs one"),
       (["--model", "gpt", "--seq-len", "100", "--gpus", "8", "--cp", "8", "--dp", "1"], "not divisible by cp 8"),
       (["--preset", "llama3-70b", "--gpus", "8", "--tp", "8"], "GB over"),
       (["--program", "parallel_3d", "--gpus", "6", "--model", "vit", "--dp", "2", "--tp", "2"], "not divisible")]


@pytest.mark.parametrize("argv,says", BAD, ids=[s for _, s in BAD])
def test_bad_input_is_one_error_line(argv, says):
    out = plan_cli(*argv)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert out.stderr.count("error:") == 1 and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- the peak above the floor, measured

VIT = ["--model", "vit", "--heads", "4", "--steps", "2"]
# (program, ranks, flags): the six kinds of layout and ZeRO's four stages; each model large enough that
# what it holds (tens of MB) stands well above the noise of a process's peak (a MB or two)
PEAK_RUNS = {
    "zero0": ("pipeline_dp_joint", 2, "--hidden 384 --layers 4 --batch-size 8 --microbatches 2 --dp 2 --zero 0"),
    "zero1": ("pipeline_dp_joint", 2, "--hidden 384 --layers 4 --batch-size 8 --microbatches 2 --dp 2 --zero 1"),
    "zero2": ("pipeline_dp_joint", 2, "--hidden 384 --layers 4 --batch-size 8 --microbatches 2 --dp 2 --zero 2"),
    "zero3": ("pipeline_dp_joint", 2, "--hidden 384 --layers 4 --batch-size 8 --microbatches 2 --dp 2 --zero 3"),
    "1f1b": ("pipeline_microbatch", 4, "--hidden 256 --layers 6 --batch-size 32 --microbatches 4 --schedule 1f1b"),
    "gpipe": ("pipeline_microbatch", 4, "--hidden 256 --layers 6 --batch-size 32 --microbatches 4 --schedule gpipe"),
    "interleaved": ("pipeline_microbatch", 4, "--hidden 256 --layers 6 --batch-size 32 --microbatches 4 "
                    "--schedule interleaved --virtual-stages 2"),
    "cp": ("context_parallel", 2, "--hidden 256 --layers 4 --batch-size 16"),
    "ep": ("expert_parallel", 2, "--hidden 256 --layers 4 --batch-size 16 --experts 4 --top-k 2"),
}


def peak_run(program, world, flags, tmp_path):
    """Each rank's peak RSS (MB) of one run. Started through mp.tools.torchrun, not the tests' zygote: the ranks
    fork from an agent started with MALLOC_MMAP_THRESHOLD_ pinned (glibc reads it when malloc first runs, which
    the zygote did long ago), so that memory freed is given back and the peak is what was held at once
    (mp/heap.py). A forked rank's ru_maxrss starts from its own pages, not the agent's peak."""
    log = os.path.join(str(tmp_path), f"{program}-{flags.count(' ')}-{len(os.listdir(tmp_path))}.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "mp.tools.torchrun", "--standalone", f"--nproc-per-node={world}", "--",
           os.path.join(ROOT, f"{program}.py"), *VIT, *FAST, *flags.split(), "--log-file", log]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(log) as f:
        return next(r for r in map(json.loads, f) if r["event"] == "summary")["peak_memory_mb"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PEAK_RUNS))
def test_peak_above_the_floor_within_15_percent(name, tmp_path, monkeypatch):
    """The planner's peak above the floor (mp/plan/peak.py) against the run's peak minus its floor's, every rank."""
    program, world, flags = PEAK_RUNS[name]
    floor_flags = re.sub(r"--hidden \d+", "--hidden 8", flags)   # the floor: the same run with a tiny model
    big, floor = peak_run(program, world, flags, tmp_path), peak_run(program, world, floor_flags, tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    predicted = peak_above_floor(program, PARSERS[program](VIT + FAST + flags.split(), program), world)
    for rank, mb in big.items():
        measured = mb - floor[rank]
        assert predicted[rank]["peak_above_floor_mb"] == pytest.approx(measured, rel=BAR), (name, rank, measured)


# --this-machine's ranking of six layouts against their runs here is a timing, in benchmarks/plan_ranking.py (paired
# rounds): on the 2 shared cores a layout's step moved up to 2x between runs minutes apart, and the suite's own
# load decides ties (Spearman 0.77-0.94 over runs, docs/planning.md). Here: what it computes, measured afresh.
TIMED_MODEL = ["--model", "vit", "--hidden", "256", "--layers", "4", "--heads", "4", "--batch-size", "32"]


@pytest.mark.slow
def test_this_machine_measures_once_and_prices_a_step_by_its_costs(tmp_path, monkeypatch):
    """The rates are measured into the cache in seconds and read back without measuring again; a step's price
    grows with what the layout adds to it: more microbatches whose ZeRO-3 weights are gathered each, and
    those weights gathered each microbatch rather than once a step."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    start = time.perf_counter()
    rates = this_machine(world=4)
    took = time.perf_counter() - start
    assert took < 30 and rates["block_gflops"] > 0 and rates["gemm_gflops"] > 0, (took, rates)
    cached = tmp_path / "cache" / "mp" / "this_machine.json"
    assert cached.exists() and this_machine(world=4) == rates == json.loads(cached.read_text())

    def price(program, world, flags):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        return step_seconds(program, PARSERS[program](TIMED_MODEL + FAST + flags.split(), program), world, rates)
    zero3 = [price("pipeline_dp_joint", 4, f"--dp 4 --microbatches {m} --zero 3 --zero3-gather microbatch")
             for m in (1, 4, 8)]
    assert zero3 == sorted(zero3) and zero3[0] < zero3[-1], zero3
    assert price("pipeline_dp_joint", 4, "--dp 4 --microbatches 8 --zero 3 --zero3-gather step") < zero3[-1]
