"""Context parallelism of the gpt: causal ring attention in the zigzag and contiguous layouts and causal Ulysses
against one process (the attention tensor by tensor, the program step by step with the loss mask, dropout,
clipping and AdamW, tied and untied), the attention work balanced by the zigzag, --check, and the bad inputs."""
import math

import pytest
import torch
from torch.testing import assert_close

import context_parallel as cp
from helpers import FAST, assert_one_error_line, launch, run_ranks, slow
from mp.cp.zigzag import DIAGONAL, FULL, SKIP, Layout, block_rule
from mp.models import causal_mask

GPT = FAST + ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--batch-size",
              "16", "--steps", "6", "--loss-mask", "prefix", "--dropout", "0.1", "--clip-grad-norm", "1"]
ADAMW = ["--optimizer", "adamw"]


def test_the_zigzag_index_maps_and_the_block_rule():
    """Rank r of C holds chunks r and 2C-1-r of 2C (contiguous: chunk r of C), at their true positions; a
    block whose keys all come after its queries is skipped, the diagonal masked; zigzag: every rank computes
    2C + 1 half-size blocks, contiguous: rank r computes r + 1."""
    assert [block_rule(q, k) for q, k in ((1, 2), (2, 2), (3, 2))] == [SKIP, DIAGONAL, FULL]
    zigzag, contiguous = Layout(4, 16, "zigzag", causal=True), Layout(4, 16, "contiguous", causal=True)
    assert [zigzag.chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert zigzag.runs(1) == [(2, 2), (12, 2)] and zigzag.positions(1).tolist() == [2, 3, 12, 13]
    assert sorted(zigzag.order().tolist()) == list(range(16)) and contiguous.order().tolist() == list(range(16))
    assert zigzag.take(torch.arange(16)[None], 3).tolist() == [[6, 7, 8, 9]]
    for r in range(4):
        blocks = [b for s in range(4) for b in zigzag.blocks(r, s)]
        assert len(blocks) == 2 * 4 + 1 and sum(masked for *_, masked in blocks) == 2
        assert sum(len(contiguous.blocks(r, s)) for s in range(4)) == r + 1
    assert zigzag.blocks(1, 1) == [(slice(0, 2), slice(0, 2), True), (slice(2, 4), slice(0, 2), False),
                                   (slice(2, 4), slice(2, 4), True)]   # q chunk 6 sees chunk 1, not 1 chunk 6
    assert zigzag.blocks(0, 2) == [(slice(2, 4), slice(0, 2), False), (slice(2, 4), slice(2, 4), False)]
    assert Layout(2, 16).blocks(0, 1) == [(slice(None), slice(None), False)]   # the vit: not causal


def causal_attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), -math.inf).softmax(-1) @ v


def case_causal_attention(rank, world, group):
    """The ring (zigzag, contiguous) and Ulysses on my tokens against plain causal attention on all: the
    output and the gradients of my q, k, v (the backward's blocks travel the other way round the ring)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 5, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 4, 16, 5)
    causal_attention(q, k, v).backward(grad_out)
    for kind in ("zigzag", "contiguous"):
        layout = Layout(world, 16, kind, causal=True)
        for name, attention in cp.ATTENTION.items():
            local = [layout.take(t.detach(), rank, dim=2).requires_grad_() for t in (q, k, v)]
            out = attention(*local, group, layout)
            out.backward(layout.take(grad_out, rank, dim=2))
            want = layout.take(causal_attention(q, k, v).detach(), rank, dim=2)
            assert_close(out, want, msg=f"{name} {kind}: output")
            for what, got, full in zip("qkv", local, (q, k, v)):
                assert_close(got.grad, layout.take(full.grad, rank, dim=2), msg=f"{name} {kind}: gradient of {what}")


def test_causal_ring_and_ulysses_match_plain_causal_attention(tmp_path):
    run_ranks(case_causal_attention, 4, tmp_path)


def relative_norms(run, reference):
    return max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
               for a, b in zip(run.events("train"), reference.events("train")))


# within 1e-6 absolute (a loss of 5.5 nats: float32's ulp there is 4.8e-7). Measured 2026-12-08: at most 4.3e-8
# with AdamW, since the tokens' cross-entropies are summed in float64 (mp.loss.sum_in_float64; in float32 a
# rank's sum in its order differed by up to 1.9e-6 with the very same weights)
LOSS_ATOL = 1e-6


@pytest.mark.parametrize("attention,layout,tied,nproc", [
    ("ring", "zigzag", True, 2), ("ulysses", "zigzag", False, 2), slow("ring", "zigzag", False, 2),
    slow("ring", "contiguous", True, 2), slow("ring", "contiguous", False, 4), slow("ulysses", "contiguous", True, 4),
    slow("ulysses", "zigzag", True, 4)])
def test_the_gpt_logs_the_baseline_losses_and_norms(tmp_path, baseline, attention, layout, tied, nproc):
    args = GPT + ADAMW + ["--eval-every", "3"] + (["--tie-embeddings"] if tied else [])
    run = launch("context_parallel.py", args + ["--attention", attention, "--cp-layout", layout], tmp_path, nproc=nproc)
    reference = baseline(args)
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = run.losses(), reference.losses()
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == len(want) == 6 and worst <= LOSS_ATOL, (worst, got, want)
    assert relative_norms(run, reference) <= 1e-6
    evals = [(a["test_loss"], a["test_acc"], b["test_loss"], b["test_acc"])
             for a, b in zip(run.events("eval"), reference.events("eval"))]
    assert len(evals) == 2 and all(abs(a - c) <= 1e-6 and b == d for a, b, c, d in evals), evals
    assert "bit-identical across" in run.stdout and ": yes" in run.stdout, run.stdout
    print(f"gpt {attention} {layout} tied={tied} cp {nproc}: largest |loss difference| {worst:.2g}")


def test_the_zigzag_balances_the_attention_work_at_4_ranks(tmp_path, baseline):
    """attention_flops per rank from the summary: zigzag within 1.05 of the mean on every rank (and the
    baseline's losses), contiguous's last rank about 2C/(C+1) = 1.6 of the mean."""
    args = GPT + ADAMW + ["--tie-embeddings"]
    run = launch("context_parallel.py", args, tmp_path, nproc=4, log_name="zigzag.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert max(abs(a - b) for a, b in zip(run.losses(), baseline(args).losses())) <= LOSS_ATOL
    contiguous = launch("context_parallel.py", GPT + ["--steps", "1", "--cp-layout", "contiguous"], tmp_path,
                        nproc=4, log_name="contiguous.jsonl")
    assert contiguous.returncode == 0, contiguous.stderr[-3000:]
    ratios = {}
    for name, r in (("zigzag", run), ("contiguous", contiguous)):
        flops = [r.events("summary")[0]["attention_flops"][str(k)] for k in range(4)]
        ratios[name] = [f / (sum(flops) / 4) for f in flops]
    assert max(ratios["zigzag"]) <= 1.05 and min(ratios["zigzag"]) >= 0.95, ratios
    assert ratios["contiguous"] == pytest.approx([0.4, 0.8, 1.2, 1.6]), ratios
    print(f"attention work / mean at cp 4: {ratios}")


@pytest.mark.parametrize("layout,nproc", [("zigzag", 2), slow("contiguous", 4)])
def test_check_flag_matches(tmp_path, layout, nproc):
    run = launch("context_parallel.py", GPT + ["--tie-embeddings", "--cp-layout", layout, "--check"], tmp_path,
                 nproc=nproc)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "model gpt" in run.stdout and "all tensors match the full model" in run.stdout, run.stdout


@pytest.mark.parametrize("argv,world,message", [
    (["--seq-len", "12"], 4, "error: --seq-len 12 is not divisible by 8: --cp-layout zigzag"),
    (["--seq-len", "10", "--cp-layout", "contiguous"], 4, "error: --seq-len 10 is not divisible by 4"),
    (["--attention", "ulysses", "--heads", "4"], 3, "error: --heads 4 is not divisible by the context-parallel"),
    (["--model", "vit", "--cp-layout", "zigzag"], 2, "error: --cp-layout zigzag balances causal attention"),
])
def test_bad_input_is_one_error_line_and_exit_2(monkeypatch, capsys, argv, world, message):
    base = [] if "vit" in argv else ["--model", "gpt", "--seq-len", "24"]
    assert_one_error_line(cp.parse_args, base + argv, world, message, monkeypatch, capsys)
