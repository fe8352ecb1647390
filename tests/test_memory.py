"""The memory contract: every rank holds only its part of the model (docs/memory.md).

The pipeline test runs a model whose weights are 184 MB, so that a stage holding the whole model (as
this program once did: its weights on top of its own gradients and momentum) fails by tens of MB
more than the noise of peak RSS (about 15 MB from run to run)."""
import pytest

import tensor_parallel as tp
from mp import replicas as replicas_mod
from mp.models import build_model, param_mb
from helpers import FAST, launch
from pipeline_microbatch import parse_args



def big(hidden):
    return FAST + ["--model", "mlp", "--layers", "12", "--hidden", str(hidden), "--batch-size", "64", "--steps", "2"]


SMALL = FAST + ["--model", "mlp", "--layers", "5", "--hidden", "64", "--batch-size", "16", "--steps", "1"]


def summary(run):
    assert run.returncode == 0, run.stderr[-3000:]
    return run.events("summary")[0]


@pytest.mark.slow
def test_each_pipeline_stage_holds_only_its_blocks(tmp_path):
    """Peak RSS above the floor (the same 4 ranks with a tiny model of the same depth) is at most this
    stage's weights, gradients and momentum, plus two of the largest block (one built during set-up
    before it is kept or dropped; one microbatch's weight gradient before it is added to .grad),
    plus 60 MB for activations, buffers and allocator slack; and the stages' param_mb sum to the model."""
    run = summary(launch("pipeline_microbatch.py", big(2048), tmp_path, nproc=4, log_name="big.jsonl"))
    floor = summary(launch("pipeline_microbatch.py", big(8), tmp_path, nproc=4, log_name="tiny.jsonl"))
    held = {int(r): mb for r, mb in run["param_mb"].items()}
    assert sum(held.values()) == pytest.approx(run["model_param_mb"], abs=1e-3)
    assert run["model_param_mb"] == pytest.approx(184.1, abs=0.1)
    largest_block = (3072 * 2048 + 2048) * 4 / 2**20       # the first Linear, 24 MB
    for rank, mb in held.items():
        above = run["peak_memory_mb"][str(rank)] - floor["peak_memory_mb"][str(rank)]
        bound = 3 * mb + 2 * largest_block + 60
        assert above <= bound, (f"stage {rank} peaked {above:.0f} MB above the floor, more than 3 x its "
                                f"{mb:.1f} MB of weights + two blocks + 60 = {bound:.0f} MB: "
                                f"{run['peak_memory_mb']} against {floor['peak_memory_mb']}")
    assert held[0] == pytest.approx(56.02, abs=0.01)   # blocks 0-2 of 12: 3072 x 2048, 2 x 2048 x 2048


def shard_totals(args):
    """(MB of the sharded tensors, MB of the replicated ones) of the full model under tensor parallelism."""
    model = tp.parallelize(build_model(args), args.model, None)   # degree 1: every layer split into one shard
    replicated = replicas_mod.replicated_parameters(model)
    ids = {id(p) for p in replicated}
    return param_mb(p for p in model.parameters() if id(p) not in ids), param_mb(replicated)


@pytest.mark.parametrize("program,flags,nproc,tp_degree", [
    ("tensor_parallel.py", [], 4, 4),
    ("parallel_3d.py", ["--dp", "1", "--tp", "2", "--microbatches", "2"], 4, 2),   # 2 stages x 2 tp ranks
])
def test_tensor_parallel_shards_sum_to_the_model(tmp_path, program, flags, nproc, tp_degree):
    """Each sharded tensor is held once over the ranks, each replicated one by every tp rank of its stage."""
    record = summary(launch(program, SMALL + flags, tmp_path, nproc=nproc))
    sharded, replicated = shard_totals(parse_args(SMALL))
    assert record["model_param_mb"] == pytest.approx(sharded + replicated, abs=1e-3)
    held = sum(record["param_mb"].values())
    assert held == pytest.approx(sharded + tp_degree * replicated, abs=1e-3), (held, sharded, replicated)
    assert max(record["param_mb"].values()) < record["model_param_mb"] / 1.5
