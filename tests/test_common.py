"""The plumbing every program relies on: data determinism and slicing, models, the metrics log."""
import json
import os

import pytest
import torch

from mp import dist as mp_dist
from mp import errors
from mp import flags as mp_flags
from mp import log as mp_log
from mp import models
from mp.data import SyntheticData, dp_slice
from mp.data import test_batches as split_of_test_set   # a test_ name would be collected by pytest


def args_for(*argv):
    args = mp_flags.base_parser("test").parse_args(list(argv))
    mp_flags.validate_common(args, "test")
    return args


def test_synthetic_batches_are_a_pure_function_of_seed_and_step():
    a, b = SyntheticData(seed=3), SyntheticData(seed=3)
    xa, ya = a.batch(17, 32)
    xb, yb = b.batch(17, 32)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.shape == (32, 3, 32, 32) and ya.shape == (32,) and ya.dtype == torch.int64
    assert not torch.equal(a.batch(18, 32)[0], xa), "consecutive steps must differ"
    assert not torch.equal(SyntheticData(seed=4).batch(17, 32)[0], xa), "seeds must differ"
    assert torch.equal(a.test_set[0], b.test_set[0])


def test_synthetic_data_stays_small():
    data = SyntheticData(seed=0)
    held = sum(t.numel() * t.element_size() for t in (data.prototypes, *data.test_set))
    assert held < 100 * 2**20


def test_dp_slices_partition_the_global_batch():
    x, _ = SyntheticData(seed=0).batch(0, 12)
    parts = [dp_slice(x, r, 3) for r in range(3)]
    assert all(p.shape[0] == 4 for p in parts)
    assert torch.equal(torch.cat(parts), x)


def test_test_batches_cover_the_test_split():
    data = SyntheticData(seed=0)
    chunks = split_of_test_set(data, 300)
    assert sum(len(y) for _, y in chunks) == len(data.test_set[1])


@pytest.mark.parametrize("model,blocks", [("cnn", 5), ("mlp", 4), ("vit", 6)])
def test_models_are_block_lists_built_identically_from_the_seed(model, blocks):
    args = args_for("--model", model, "--seed", "5", *(["--hidden", "32"] if model != "cnn" else []))
    a, b = models.build_model(args), models.build_model(args)
    assert len(a) == blocks
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_cnn_normalisation_is_per_sample():
    """A sample's output must not depend on the rest of its batch (docs/equivalence.md, point 4)."""
    model = models.build_model(args_for("--model", "cnn"))
    x = torch.randn(6, 3, 32, 32)
    torch.testing.assert_close(model(x)[:2], model(x[:2]))


def test_vit_attention_reads_the_head_count_off_its_weights():
    attn = models.Attention(dim=32, heads=4)
    assert attn.head_dim == 8
    assert attn(torch.randn(2, 5, 32)).shape == (2, 5, 32)


def test_metrics_log_writes_flushed_json_lines(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    path.parent.mkdir()
    path.write_text("an earlier run's complete log\n")
    log = mp_log.MetricsLog(str(path), enabled=True, steps=3)
    log.write("train", step=0, loss=1.5)
    partial = tmp_path / "sub" / f"log.partial-{os.getpid()}.jsonl"          # until the run ends
    assert json.loads(partial.read_text()) == {"event": "train", "step": 0, "loss": 1.5}  # flushed
    assert path.read_text() == "an earlier run's complete log\n"             # untouched until then
    assert log.interrupted_line() == (f"interrupted at step 1 of 0-2: kept steps 0-0 in {partial}; {path} "
                                      "(an earlier run's) is untouched")
    log.close()
    assert json.loads(path.read_text())["loss"] == 1.5 and not partial.exists()   # complete, under its name
    silent = mp_log.MetricsLog(str(tmp_path / "never.jsonl"), enabled=False)
    silent.write("train", step=0, loss=1.0)
    assert not (tmp_path / "never.jsonl").exists()


def test_peak_memory_is_reported_in_megabytes():
    env = mp_dist.torchrun_env("gloo")
    peak = mp_log.gather_peak_memory(env)
    assert list(peak) == [0] and 10 < peak[0] < 24_000


def test_validation_names_the_numbers(capsys):
    with pytest.raises(SystemExit) as exit_info:
        args_for("--model", "vit", "--hidden", "30", "--heads", "4")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --hidden 30 is not divisible by --heads 4") and err.count("\n") == 1


@pytest.mark.parametrize("seen_by,rank,local_rank,printed", [
    ("every rank", "0", "0", True), ("every rank", "3", "0", False),      # the flags: rank 0 says it once
    ("every node", "3", "0", True), ("every node", "4", "1", False),      # a node's data dir: its local rank 0
    ("this rank", "5", "1", True)])                                       # a NaN loss: where it happened
def test_an_error_is_printed_once_where_it_is_seen_and_every_rank_exits_2(capsys, monkeypatch, seen_by, rank,
                                                                          local_rank, printed):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(SystemExit) as e:
        errors.fail("the numbers, and the fix", seen_by=seen_by)
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: the numbers, and the fix\n" if printed else "")
