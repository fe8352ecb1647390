"""The planner's exact counts (mp/plan/project.py) against fresh runs of the gpt (issue 84, item 3: any layout of
every program): the tied embedding's group, the vocabulary split over tp, the zigzag's token chunks and the loss
mask change what a rank holds and sends. Each run's summary is compared field by field (tests/test_plan.py's
assert_same), one launch a layout."""
import pytest

from helpers import FAST, launch
from test_plan import assert_same
from mp.cli import PARSERS
from mp.plan.project import counts

GPT = ["--model", "gpt", "--hidden", "32", "--layers", "2", "--heads", "4", "--seq-len", "16", "--loss-mask", "prefix",
       "--steps", "2"]
LAYOUTS = [   # (program, world, flags)
    ("pipeline_microbatch", 4, "--batch-size 8 --microbatches 4 --schedule 1f1b --tie-embeddings"),
    ("pipeline_dp_joint", 4, "--dp 2 --batch-size 8 --microbatches 2 --zero 1 --tie-embeddings"),
    ("pipeline_dp_joint", 4, "--dp 2 --batch-size 8 --microbatches 2 --zero 2 --bucket-mb 0.01 --tie-embeddings"),
    ("pipeline_dp_joint", 4, "--dp 2 --batch-size 8 --microbatches 2 --zero 0 --bucket-mb 0.01 --tie-embeddings"),
    ("tensor_parallel", 2, "--batch-size 8 --tie-embeddings"),
    ("tensor_parallel", 2, "--batch-size 8 --sequence-parallel"),
    ("context_parallel", 2, "--batch-size 8 --attention ring --cp-layout zigzag --tie-embeddings"),
    ("context_parallel", 2, "--batch-size 8 --attention ulysses --cp-layout contiguous"),
    ("expert_parallel", 2, "--batch-size 32 --experts 4 --top-k 2 --tie-embeddings"),   # a route near the even one
    ("parallel_3d", 4, "--dp 1 --tp 2 --batch-size 8 --microbatches 2 --tie-embeddings"),
    ("parallel_3d", 8, "--dp 2 --tp 2 --batch-size 8 --microbatches 2 --zero 3 --bucket-mb 0.01 --tie-embeddings"),
    ("parallel_5d", 4, "--cp 2 --ep 2 --experts 4 --top-k 2 --batch-size 16 --microbatches 2 --tie-embeddings"),
    ("parallel_5d", 8, "--dp 2 --cp 2 --tp 2 --batch-size 8 --microbatches 2 --sequence-parallel --tie-embeddings"),
]
FIELDS = ("param_mb", "grad_mb", "optimizer_state_mb", "dp_sent_mb_per_step", "sent_mb_per_step",
          "all_to_all_mb_per_step")


@pytest.mark.slow
@pytest.mark.parametrize("program,world,flags", LAYOUTS, ids=[f"{p}-{w}-{i}" for i, (p, w, _) in enumerate(LAYOUTS)])
def test_gpt_counts_equal_a_fresh_run(program, world, flags, tmp_path, monkeypatch):
    argv = GPT + FAST + flags.split()
    run = launch(f"{program}.py", argv, tmp_path, nproc=world)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = run.events("summary")[0]
    measured = {k: summary[k] for k in FIELDS if k in summary}
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert_same(counts(program, PARSERS[program](argv, program), world), measured)
