"""The test helpers fail a test when any rank fails (issue 43): a rank that fails after rank 0 has
finished cleanly is a failure, and a forked rank starts like a fresh interpreter (its own random
state, no tests/ on a program's path)."""
import json
import os
import random
import time

import numpy
import pytest

from helpers import ROOT, USE_ZYGOTE, forked, run_ranks


def _late_failure_case(rank, world, group):
    if rank == world - 1:
        time.sleep(1.0)                       # rank 0 has returned by now
        raise AssertionError("the last rank failed after rank 0 had finished")


def test_run_ranks_fails_when_the_last_rank_fails_after_rank_0_finished(tmp_path):
    with pytest.raises(Exception) as failure:   # AssertionError here; torch's ProcessRaisedException under spawn
        run_ranks(_late_failure_case, 2, tmp_path)
    assert "the last rank failed after rank 0 had finished" in str(failure.value)


def _random_state_case(rank, world, group):
    import torch.distributed as dist
    mine = (random.random(), float(numpy.random.random()))   # Python reseeds random at fork; numpy does not
    every = [None] * world
    dist.all_gather_object(every, mine)
    for i, name in enumerate(("random", "numpy.random")):
        assert every[0][i] != every[1][i], f"both ranks drew {every[0][i]} from {name}"


def test_each_rank_draws_its_own_random_numbers(tmp_path):
    run_ranks(_random_state_case, 2, tmp_path)


@pytest.mark.skipif(not USE_ZYGOTE, reason="the real python has no tests/ on a program's path to begin with")
def test_a_program_does_not_see_tests_on_its_path(tmp_path):
    """A program run through the zygote imports what `python program.py` would: not tests/'s modules."""
    script = tmp_path / "probe.py"
    script.write_text("import json, os, sys\nprint(json.dumps([os.path.abspath(p or '.') for p in sys.path]))\n")
    code, stdout, stderr, _ = forked({"kind": "script", "script": str(script), "argv": [], "nproc": 1},
                                     str(tmp_path), 60, dict(os.environ))
    assert code == 0, stderr
    assert os.path.join(ROOT, "tests") not in json.loads(stdout.splitlines()[-1])
