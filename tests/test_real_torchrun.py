"""The zygote (tests/zygote.py) forks every rank from one process; these runs go through the real
python and torchrun instead, so that it is never the only witness (issue 43): each of the five
programs once, its per-step losses against the baseline's (itself run by the real python)."""
import pytest

from helpers import FAST, assert_same_losses, launch

ARGS = FAST + ["--steps", "3", "--dropout", "0.1", "--clip-grad-norm", "0.5"]
RUNS = [   # program, ranks, its own flags
    ("pipeline_microbatch.py", 2, ["--schedule", "zb"]),
    ("pipeline_dp_joint.py", 4, ["--dp", "2", "--microbatches", "2", "--batch-size", "64"]),
    ("tensor_parallel.py", 2, []),
    ("parallel_3d.py", 4, ["--dp", "1", "--tp", "2", "--microbatches", "2"]),
]


@pytest.fixture(scope="module")
def real_baseline(tmp_path_factory):
    run = launch("single_baseline.py", ARGS, tmp_path_factory.mktemp("real-baseline"), real=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("program,nproc,flags", RUNS, ids=[r[0] for r in RUNS])
def test_each_program_under_the_real_torchrun_gives_the_baselines_losses(program, nproc, flags, tmp_path,
                                                                        real_baseline):
    run = launch(program, ARGS + flags, tmp_path, nproc=nproc, real=True)
    assert_same_losses(run, real_baseline)
