"""The gpt's mixture of experts spread over the ranks (expert_parallel.py --model gpt): each rank's slice of
the batch holds its own count of valid tokens (--loss-mask), and each scales by the global batch's count."""
import pytest

from helpers import launch

GPT = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch-size", "16",
       "--data", "synthetic", "--steps", "6", "--loss-mask", "prefix", "--dropout", "0.1", "--clip-grad-norm", "1",
       "--optimizer", "adamw", "--log-every", "3", "--threads", "1"]


def assert_same_steps(run, reference, rtol=1e-6):
    """The loss of every step and the evaluation's within 1e-6 of the baseline's (absolute), grad_norm and the
    accuracy within rtol."""
    assert run.returncode == 0, run.stderr[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
    for event, keys in (("train", ("loss", "grad_norm")), ("eval", ("test_loss", "test_acc"))):
        got, want = run.events(event), reference.events(event)
        assert len(got) == len(want) > 0, (event, len(got), len(want))
        for a, b in zip(got, want):
            for k in keys:
                bound = 1e-6 if "loss" in k else rtol * abs(b[k]) + 1e-7
                assert abs(a[k] - b[k]) <= bound, (event, a["step"], k, a[k], b[k])


@pytest.mark.parametrize("extra", [["--experts", "4", "--top-k", "2", "--capacity-factor", "1.25",
                                    "--tie-embeddings"]])
def test_expert_parallel_gpt_matches_the_baseline_every_step(tmp_path, extra):
    args = GPT + extra + ["--eval-every", "6"]
    run = launch("expert_parallel.py", args, tmp_path, nproc=2)
    assert_same_steps(run, launch("single_baseline.py", args, tmp_path))
    assert "replicated weights bit-identical across the 2 expert-parallel ranks: yes" in run.stdout


def test_expert_parallel_gpt_check_matches_the_full_model(tmp_path):
    run = launch("expert_parallel.py", GPT + ["--experts", "4", "--eval-every", "0", "--check"], tmp_path, nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "all tensors match the full model" in run.stdout, run.stdout
