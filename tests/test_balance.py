"""--balance auto (mp/pp/balance.py): a split computed from counted flops per block, the same on every call
and every rank, whose slowest stage is never worse than the even split's, resolved before any
collective into the explicit list the programs already take; the losses stay the baseline's."""
import argparse
import itertools

import pytest
import torch

from mp.pp import balance
from mp.sizes import split_sizes
import pipeline_microbatch as pm
from helpers import FAST, PYTHON, assert_one_error_line, assert_same_losses, launch


def model_args(model="cnn", layers=4, hidden=128):
    return argparse.Namespace(model=model, layers=layers, hidden=hidden, heads=4, seed=0, dropout=0.0,
                              activation="gelu")


def test_the_costs_are_counted_so_the_split_is_the_same_every_time():
    args = model_args()
    first = balance.block_flops(args)
    torch.manual_seed(123)                     # the global random state does not enter
    assert balance.block_flops(args) == first and all(isinstance(c, int) and c > 0 for c in first)
    assert balance.block_flops(argparse.Namespace(**{**vars(args), "seed": 7})) == first   # nor the weights: shapes
    assert balance.auto_balance(args, 4) == balance.auto_balance(args, 4) == "1,1,1,2"


@pytest.mark.parametrize("model,layers,hidden,stages,want", [
    ("cnn", 4, 128, 4, [1, 1, 1, 2]),        # the even 2,1,1,1 puts both convolutions on stage 0
    ("cnn", 4, 128, 2, [1, 4]),
    ("mlp", 8, 1024, 2, [3, 5]),             # docs/results.md's hand-made split: 3072 x 1024 first
    ("mlp", 4, 128, 4, [1, 1, 1, 1]),        # one block a stage: the only split
])
def test_auto_is_never_slower_than_even_by_the_count(model, layers, hidden, stages, want):
    costs = balance.block_flops(model_args(model, layers, hidden))
    slowest, split = balance.best_split(costs, stages)
    assert split == want and slowest == balance.stage_max(costs, split)
    even = balance.stage_max(costs, split_sizes(len(costs), stages))
    assert slowest <= even
    if model == "cnn":
        assert slowest < 0.6 * even          # both convolutions apart: the slowest stage nearly halves


def test_the_search_finds_the_best_split_of_consecutive_blocks():
    costs = balance.block_flops(model_args("mlp", 6, 64))
    for stages in (1, 2, 3, 4):
        every = [s for s in itertools.product(range(1, 7), repeat=stages) if sum(s) == 6]
        assert balance.best_split(costs, stages)[0] == min(balance.stage_max(costs, s) for s in every)


def test_zbv_balances_each_ranks_two_chunks_not_each_chunk():
    """The V: rank r holds chunks r and 2p-1-r, so the search minimises the slowest rank's sum (then the
    largest chunk); checked against every split of small random costs, and on the benchmark's mlp."""
    rng = __import__("random").Random(0)
    for _ in range(60):
        n, ranks = rng.randint(4, 8), rng.choice([1, 2, 3])
        if 2 * ranks > n:
            continue
        costs = [rng.randint(1, 20) for _ in range(n)]
        every = [s for s in itertools.product(range(1, n + 1), repeat=2 * ranks) if sum(s) == n]
        least = min(balance.rank_max(costs, s) for s in every)
        slowest, split = balance.v_split(costs, ranks)
        assert slowest == least == balance.rank_max(costs, split)
        assert balance.stage_max(costs, split) == min(balance.stage_max(costs, s) for s in every
                                                      if balance.rank_max(costs, s) == least)
    costs = balance.block_flops(model_args("mlp", 14, 768))   # benchmarks/zero_bubble.py --paired-zbv
    assert balance.v_split(costs, 2)[1] == [2, 3, 4, 5]      # rank 0: blocks 0-1 and 9-13; rank 1: 2-8
    assert balance.best_split(costs, 4)[1] == [2, 4, 4, 4]  # chunk by chunk: rank 1 would hold 8 of 14
    assert balance.rank_max(costs, [2, 3, 4, 5]) < 0.97 * balance.rank_max(costs, [2, 4, 4, 4])


def test_auto_is_resolved_before_any_collective_into_the_explicit_list(monkeypatch):
    import parallel_3d
    import pipeline_dp_joint
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = pm.parse_args(FAST + ["--balance", "auto", "--schedule", "interleaved"])
    assert args.balance == "1,1,1,2"          # 2 stages x 2 virtual stages = 4 chunks of the cnn's 5 blocks
    zbv = pm.parse_args(FAST + ["--model", "mlp", "--layers", "14", "--hidden", "768", "--balance", "auto",
                                "--schedule", "zbv"])
    assert zbv.balance == "2,3,4,5"            # the V's split (v_split), not the chunk-by-chunk one
    monkeypatch.setenv("WORLD_SIZE", "4")     # the joint and 3-D programs share the flags: 2 stages each
    assert pipeline_dp_joint.parse_args(FAST + ["--balance", "auto", "--dp", "2"]).balance == "1,4"
    assert parallel_3d.parse_args(FAST + ["--balance", "auto", "--dp", "1", "--tp", "2"]).balance == "1,4"


@pytest.mark.parametrize("argv,world,message", [
    (["--balance", "auto"], 6, "error: 6 pipeline stages but the cnn has only 5 blocks"),
    (["--balance", "even"], 2, "error: --balance 'even' must be comma-separated integers, e.g. 2,1,1,1, or auto"),
])
def test_bad_auto_is_one_error_line(monkeypatch, capsys, argv, world, message):
    assert_one_error_line(pm.parse_args, FAST + argv, world, message, monkeypatch, capsys)


@pytest.mark.parametrize("schedule,nproc,extra", [("1f1b", 4, []), ("interleaved", 2, ["--virtual-stages", "2"])])
def test_auto_logs_the_baseline_losses(tmp_path, baseline, schedule, nproc, extra):
    args = FAST + ["--steps", "8", "--batch-size", "16"]
    run = launch("pipeline_microbatch.py", args + ["--balance", "auto", "--schedule", schedule, *extra], tmp_path,
                 nproc=nproc)
    assert_same_losses(run, baseline(args))
    config, = run.events("config")
    assert config["args"]["balance"] == "1,1,1,2"    # the log says which split ran


@pytest.mark.slow
def test_the_pipeline_launcher_takes_balance_as_a_knob_and_names_the_runs_by_it(tmp_path):
    import os
    import subprocess
    from helpers import ROOT
    env = dict(os.environ, PYTHON=PYTHON, LOGS=str(tmp_path), DATA="synthetic", EVAL_EVERY="0",
               OMP_NUM_THREADS="1", NPROC="2", SCHEDULE="1f1b", STEPS="2")
    run = subprocess.run(["bash", os.path.join(ROOT, "run_pipeline.sh")], env=dict(env, BALANCE="4,x"),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: BALANCE '4,x' must be"), run.stderr
    run = subprocess.run(["bash", os.path.join(ROOT, "run_pipeline.sh")], env=dict(env, BALANCE="auto"),
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    log, = tmp_path.glob("pipeline_cnn_steps2_synthetic_evalevery0_1f1b_p2_m4_b64_balanceauto.jsonl")
    assert '"balance": "1,4"' in log.read_text()
    assert (tmp_path / "plots" / "pipeline_timeline_nproc2_1f1b_steps2_synthetic_evalevery0_balanceauto.png").exists()
