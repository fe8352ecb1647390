"""The gpt on the composed meshes: parallel_3d.py (dp x pp x tp: the vocabulary-parallel embedding on the first
stage, head and cross-entropy on the last, the tied rows summed between them over the embed group) and
parallel_5d.py (and cp's causal layouts, each token at its true position, and the experts folded over
dp x cp x tp) against the baseline step by step with the loss mask, dropout, clipping and AdamW; --check; the
bad input."""
import pytest

import parallel_3d
import parallel_5d
from helpers import FAST, assert_one_error_line, launch, slow
from mp.mesh import embedding_lines, layout, lines

GPT = FAST + ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch-size",
              "16", "--steps", "6", "--loss-mask", "prefix", "--dropout", "0.1", "--clip-grad-norm", "1"]
ADAMW = ["--optimizer", "adamw"]
TIED = ["--tie-embeddings"]
# the bounds: the loss within 1e-6 absolute (on ~5.4 nats), the grad norm within 1e-6 relative; the
# tokens' cross-entropies are summed in float64 (mp.loss.sum_in_float64: in float32 the microbatches' and the
# ranks' sums in their order differed by up to 1.9e-6 with the very same weights)
LOSS_ATOL, NORM_RTOL = 1e-6, 1e-6
_baselines = {}


def baseline(args, tmp_path_factory):
    """single_baseline.py with the same flags, once per flag set (the program's layout flags left out)."""
    key = tuple(args)
    if key not in _baselines:
        _baselines[key] = launch("single_baseline.py", args, tmp_path_factory.mktemp("baseline"))
    return _baselines[key]


def assert_exact(run, reference):
    """Each step's loss (1e-6) and grad norm (relative 1e-6) as the baseline's; the evaluations' figures as well."""
    assert run.returncode == 0, run.stderr[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
    for event in ("train", "eval"):
        got = [r for r in run.records if r["event"] == event]
        want = [r for r in reference.records if r["event"] == event]
        assert len(got) == len(want) and (got or event == "eval"), (event, len(got), len(want))
        for a, b in zip(got, want):
            for key, bound in (("loss", LOSS_ATOL), ("grad_norm", NORM_RTOL * b.get("grad_norm", 0)),
                               ("test_loss", LOSS_ATOL)):
                if key in b:
                    assert abs(a[key] - b[key]) <= bound, (event, a["step"], key, a[key], b[key])


# ----------------------------------------------------------------------------- parallel_3d.py


def test_the_embed_group_pairs_the_same_dp_cp_and_tp_coordinates():
    """Each tp rank's vocabulary rows of the tied weight are summed with the same rows only: the embed group is a
    pp line, its first and last stage at one (dp, cp, tp) coordinate; a middle stage's rank is alone."""
    assert embedding_lines(lines(layout(8, dp=2, tp=2))["pp"], (0, 1)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert embedding_lines(lines(layout(16, dp=2, cp=2, tp=2))["pp"], (0, 1))[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert embedding_lines(lines(layout(6, tp=2))["pp"], (0, 2)) == [[0, 4], [2], [1, 5], [3]]


@pytest.mark.parametrize("flags, ranks", [
    (TIED + ["--dp", "2", "--tp", "2", "--schedule", "zbv", "--microbatches", "2", "--zero", "1"], 8),
    slow(TIED + ["--dp", "1", "--tp", "2", "--microbatches", "2", "--sequence-parallel"], 4),
    slow(TIED + ["--dp", "2", "--tp", "2", "--microbatches", "2", "--zero", "3", "--bucket-mb", "0.01"], 8),
    slow(["--dp", "1", "--tp", "2", "--layers", "4", "--schedule", "interleaved", "--virtual-stages", "2",
          "--microbatches", "4"], 4)])
def test_the_gpt_in_3d_matches_the_baseline(tmp_path, tmp_path_factory, flags, ranks):
    args = GPT + ADAMW + ["--eval-every", "3"] + flags   # evaluated after steps 2 and 5
    layout = {"--dp", "--tp", "--schedule", "--microbatches", "--zero", "--bucket-mb", "--virtual-stages"}
    base = [a for i, a in enumerate(args) if a not in layout and args[i - 1] not in layout
            and a != "--sequence-parallel"]
    run = launch("parallel_3d.py", args, tmp_path, nproc=ranks)
    assert_exact(run, baseline(base, tmp_path_factory))
    assert "replicated parameters bit-identical across the 2 tensor-parallel ranks: yes" in run.stdout
    if "--tie-embeddings" in flags and "zbv" not in flags:   # zbv: rank 0 holds both ends, one Parameter
        assert "the tied embedding weight bit-identical on the first and last stage: yes" in run.stdout


@pytest.mark.parametrize("flags", [["--sequence-parallel"], slow(["--dp", "2", "--zero", "3", "--bucket-mb", "0.01"])])
def test_the_gpt_3d_check_matches_the_full_model(tmp_path, flags):
    # SGD: AdamW's first step divides the gradient of attention's key bias, which the softmax makes 0 up to
    # rounding, by its own size (tests/test_gpt_tp.py says so too)
    ranks = 8 if "--dp" in flags else 4
    run = launch("parallel_3d.py", GPT + TIED + ["--tp", "2", "--microbatches", "2", "--check"]
                 + (flags if "--dp" in flags else ["--dp", "1"] + flags), tmp_path, nproc=ranks)
    assert run.returncode == 0 and "all tensors match the full model" in run.stdout, run.stdout + run.stderr[-2000:]


@pytest.mark.parametrize("argv, world, message", [
    (["--tp", "3", "--dp", "1", "--hidden", "48", "--heads", "3"], 6,
     "error: the gpt's vocabulary of 256 bytes is not divisible by the tensor-parallel degree 3"),
    (["--tp", "2", "--dp", "1", "--seq-len", "15", "--sequence-parallel"], 4,
     "error: --seq-len 15 is not divisible by the tensor-parallel degree 2"),
    (TIED + ["--tp", "2", "--dp", "2", "--zero", "3", "--schedule", "zbv"], 8,
     "error: --tie-embeddings with --zero 3 and --schedule zbv")])
def test_bad_3d_gpt_input_is_one_error_line(argv, world, message, monkeypatch, capsys):
    argv = ["--data", "synthetic", "--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4",
            "--seq-len", "16", "--batch-size", "16"] + argv
    assert_one_error_line(parallel_3d.parse_args, argv, world, message, monkeypatch, capsys)


# ----------------------------------------------------------------------------- parallel_5d.py

MOE = ["--experts", "4", "--top-k", "2", "--microbatches", "2"]   # the baseline routes each microbatch too


@pytest.mark.parametrize("flags", [
    ["--cp", "2", "--tp", "2", "--ep", "2"],                              # pp 2 x cp 2 x tp 2: the zigzag ring
    slow(["--cp", "2", "--tp", "2", "--ep", "2", "--attention", "ulysses"]),
    slow(["--cp", "2", "--tp", "2", "--ep", "2", "--cp-layout", "contiguous", "--sequence-parallel"]),
    slow(["--dp", "2", "--cp", "2", "--tp", "2", "--ep", "4", "--zero", "1"]),
    slow(["--cp", "2", "--tp", "2", "--ep", "2", "--zero", "3", "--schedule", "1f1b", "--sequence-parallel"])])
def test_the_gpt_in_5d_matches_the_baseline(tmp_path, tmp_path_factory, flags):
    args = GPT + ADAMW + TIED + MOE + ["--eval-every", "3"]
    run = launch("parallel_5d.py", args + flags, tmp_path, nproc=8)
    assert_exact(run, baseline(args, tmp_path_factory))
    assert "the tied embedding weight bit-identical on the first and last stage: yes" in run.stdout or "--dp" in flags


@pytest.mark.parametrize("flags", [
    ["--dp", "2", "--cp", "2", "--tp", "2", "--ep", "2", "--attention", "ulysses", "--sequence-parallel"],
    slow(["--cp", "2", "--tp", "2", "--ep", "2", "--zero", "1", "--cp-layout", "contiguous"])])
def test_the_gpt_5d_check_matches_the_full_model(tmp_path, flags):
    run = launch("parallel_5d.py", GPT + TIED + MOE + ["--check"] + flags, tmp_path, nproc=8)   # SGD: see above
    assert run.returncode == 0 and "all tensors match the full model" in run.stdout, run.stdout + run.stderr[-2000:]


@pytest.mark.parametrize("argv, world, message", [
    (["--cp", "2", "--seq-len", "18"], 4, "error: --seq-len 18 is not divisible by 4: --cp-layout zigzag"),
    (["--cp", "2", "--seq-len", "15", "--cp-layout", "contiguous"], 4,
     "error: --seq-len 15 is not divisible by 2: --cp-layout contiguous"),
    (["--cp", "2", "--tp", "4", "--seq-len", "20", "--sequence-parallel"], 8,
     "error: --seq-len 20 is not divisible by --cp 2 x --tp 4 = 8 (--sequence-parallel)"),
    (["--tp", "3", "--hidden", "48", "--heads", "3"], 3,
     "error: the gpt's vocabulary of 256 bytes is not divisible by the tensor-parallel degree 3"),
    (["--cp", "2", "--experts", "4", "--capacity-factor", "1"], 4,
     "error: --capacity-factor with --cp 2 --cp-layout zigzag"),
    (["--model", "vit", "--cp", "2", "--cp-layout", "zigzag"], 4,
     "error: --cp-layout zigzag balances causal attention")])
def test_bad_5d_gpt_input_is_one_error_line(argv, world, message, monkeypatch, capsys):
    gpt = [] if "vit" in argv else ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len",
                                    "16", "--batch-size", "16"]
    assert_one_error_line(parallel_5d.parse_args, ["--data", "synthetic"] + gpt + argv, world, message, monkeypatch,
                          capsys)
