"""The mixture of experts (--experts, mp/moe.py) in one process: the router's arithmetic against a plain
loop, capacity dropping the same tokens whether the batch is routed whole or in slices, the load-balancing
loss, the baseline training it, the dense model untouched, and the bad inputs refused."""
import argparse

import pytest
import torch.nn.functional as F
import torch
import torch.nn as nn
from torch.testing import assert_close

from helpers import FAST, assert_one_error_line, launch
from mp import moe
from mp.cli import PARSERS
from mp.models import build_model


def vit_args(**kw):
    base = dict(model="vit", layers=2, hidden=16, heads=4, patch_size=4, seed=0, dropout=0.0, activation="gelu",
                experts=4, top_k=2, capacity_factor=None, aux_loss=0.01)
    return argparse.Namespace(**{**base, **kw})


def test_a_dense_model_is_unchanged_and_a_moe_has_the_experts_by_name():
    dense = build_model(vit_args(experts=0))
    assert [n for n, _ in dense.named_parameters() if ".mlp." in n][:2] == ["1.mlp.0.weight", "1.mlp.0.bias"]
    assert moe.aux_loss(dense) is None
    names = [n for n, _ in build_model(vit_args(experts=4)).named_parameters() if ".mlp." in n]
    assert names[0] == "1.mlp.router.weight" and "1.mlp.experts.3.2.bias" in names


def plain_moe(block, x):
    """The block's output token by token, written as a loop (the definition, no batching)."""
    probs = block.router(x).softmax(-1)
    out = torch.zeros_like(x)
    for t in range(len(x)):
        w, e = probs[t].topk(block.top_k)
        w = w / w.sum() if block.top_k > 1 else w
        for weight, expert in zip(w, e):
            out[t] += weight * block.experts[int(expert)](x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_dropless_block_is_the_plain_loop(top_k):
    torch.manual_seed(0)
    block = moe.MixtureOfExperts(8, 4, top_k, None, 0.01, nn.GELU, None)
    x = torch.randn(3, 5, 8)
    assert_close(block(x), plain_moe(block, x.reshape(15, 8)).view(3, 5, 8))


def test_capacity_drops_the_same_choices_routed_whole_or_in_slices():
    """Expert parallelism routes each rank's slice with every rank's counts: the kept choices must be those
    of the whole batch routed at once (first choices before second ones, each in token order)."""
    torch.manual_seed(1)
    experts, top_k, tokens, ranks = 4, 2, 24, 3
    choice = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    choice[:10, 0] = 2                                           # an overloaded expert
    whole = moe.slot_counts(choice, experts)[None]
    capacity = moe.capacity_of(tokens, experts, top_k, 1.0)
    keep = moe.kept_mask(choice, whole, 0, capacity)
    assert capacity == 12 and int(keep.sum()) < tokens * top_k
    for e in range(experts):                                     # the definition: the first `capacity` in order
        order = [(k, t) for k in range(top_k) for t in range(tokens) if choice[t, k] == e]
        assert [keep[t, k].item() for k, t in order] == [i < capacity for i in range(len(order))]
    parts = choice.tensor_split(ranks)
    every = torch.stack([moe.slot_counts(p, experts) for p in parts])
    assert torch.equal(torch.cat([moe.kept_mask(p, every, r, capacity) for r, p in enumerate(parts)]), keep)
    kept = moe.kept_counts(every, capacity)                      # what every rank computes of every rank's
    for r, p in enumerate(parts):
        mask = moe.kept_mask(p, every, r, capacity)
        assert torch.equal(kept[r], torch.stack([torch.bincount(p[:, k][mask[:, k]], minlength=experts)
                                                 for k in range(top_k)]))


def test_the_kept_choices_sorted_by_expert_without_reading_the_mask():
    """sorted_by_expert takes how many choices are kept from the one read (not nonzero's length): the
    kept (token, slot) pairs grouped by expert, each expert's in token order, the dropped ones left out."""
    torch.manual_seed(2)
    experts, top_k, tokens = 4, 2, 16
    choice = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    counts = moe.slot_counts(choice, experts)[None]
    assert torch.equal(counts[0], torch.stack([torch.bincount(c, minlength=experts) for c in choice.T]))
    capacity = moe.capacity_of(tokens, experts, top_k, 0.75)
    keep = moe.kept_mask(choice, counts, 0, capacity)
    sizes = moe.kept_counts(counts, capacity).sum(dim=1)[0].tolist()
    token, slot = moe.sorted_by_expert(keep, choice, experts, sum(sizes))
    expected = [(t, k) for e in range(experts) for t in range(tokens) for k in range(top_k)
                if choice[t, k] == e and keep[t, k]]
    assert list(zip(token.tolist(), slot.tolist())) == expected
    assert [sum(1 for t, k in expected if choice[t, k] == e) for e in range(experts)] == sizes


def test_the_load_balancing_loss_is_one_times_its_weight_when_the_load_is_even():
    counts = torch.tensor([[[3, 3, 3, 3]]])                       # [N=1, K=1, E=4]: 12 tokens, even
    assert_close(moe.aux_loss_share(torch.full((12, 4), 0.25), counts, 0.5), torch.tensor(0.5))
    uneven = torch.tensor([[[12, 0, 0, 0]]])
    probs = torch.tensor([[1.0, 0, 0, 0]]).repeat(12, 1)
    assert_close(moe.aux_loss_share(probs, uneven, 1.0), torch.tensor(4.0))   # all on one expert: E


def test_the_baseline_trains_a_mixture_of_experts_and_logs_the_load(tmp_path):
    args = FAST + ["--model", "vit", "--hidden", "16", "--layers", "2", "--batch-size", "8", "--steps", "3",
                   "--experts", "4", "--top-k", "2", "--capacity-factor", "1.0", "--log-every", "1"]
    run = launch("single_baseline.py", args, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    summary, = run.events("summary")
    loads, dropped = summary["tokens_per_expert"], summary["dropped_per_step"]
    assert len(loads) == 3 and all(len(step) == 2 and len(step[0]) == 4 for step in loads)
    assert all(sum(block) == 8 * 64 * 2 for step in loads for block in step)     # every token's two choices
    assert len(dropped) == 3 and all(d > 0 for d in dropped)                       # C = 1.0 drops some


@pytest.mark.parametrize("program,argv,message", [
    ("tensor_parallel", ["--model", "vit", "--experts", "4"],
     "error: --experts 4: tensor_parallel.py runs the dense vit only; train the mixture of experts with"),
    ("single_baseline", ["--model", "cnn", "--experts", "4"], "error: --model cnn does not use --experts"),
    ("single_baseline", ["--model", "vit", "--top-k", "2"],
     "error: --top-k 2 shapes a mixture of experts and this run is dense (--experts 0); add --experts E"),
    ("single_baseline", ["--model", "vit", "--experts", "1", "--top-k", "2"],
     "error: --top-k 2 is more than --experts 1"),
    ("single_baseline", ["--model", "vit", "--experts", "4", "--capacity-factor", "0"],
     "error: --capacity-factor 0.0 must be a finite number > 0"),
    ("single_baseline", ["--model", "vit", "--experts", "4", "--aux-loss", "-1"],
     "error: --aux-loss -1.0 must be a finite number >= 0"),
    ("single_baseline", ["--model", "vit", "--experts", "-2"], "error: --experts -2 must be >= 0"),
    ("single_baseline", ["--batch-size", "8", "--microbatches", "3"],
     "error: --microbatches 3 must be a positive divisor of --batch-size 8 (microbatch m is samples m*B/M .. "
     "(m+1)*B/M - 1): use --microbatches 2 or 4"),
])
def test_bad_expert_flags_are_one_error_line(monkeypatch, capsys, program, argv, message):
    def parse(a):
        return PARSERS[program](a, "")
    assert_one_error_line(parse, ["--data", "synthetic"] + argv, 1 if program == "single_baseline" else 2,
                          message, monkeypatch, capsys)


def test_the_combine_weights_the_outputs():
    y = torch.ones(3, 2)
    out = moe.combine(y, torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), torch.tensor([[0.25, 0.75], [1.0, 0]]), 2)
    assert_close(out, torch.tensor([[1.0, 1.0], [1.0, 1.0]]))


def test_the_baseline_routes_each_microbatch_on_its_own():
    """single_baseline.py --microbatches M (issue 64): one forward of the whole batch whose MoE layers route
    each microbatch apart (its f_i, capacity and order) gives the loss and every gradient of M microbatches
    run one after the other, each loss weighing 1/M, as a pipeline runs them; the load record sums them."""
    torch.manual_seed(3)
    args, m = vit_args(capacity_factor=1.0), 2
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    split, apart = build_model(args), build_model(args)
    for layer in moe.moe_layers(split):
        layer.microbatches = m
    with split.dropout_keys.training(0):
        loss = moe.plus_aux_loss(split, F.cross_entropy(split(x), y))
    loss.backward()
    total = 0
    with apart.dropout_keys.training(0):
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            part = moe.plus_aux_loss(apart, F.cross_entropy(apart(xm), ym)) / m
            part.backward()
            total = total + part.detach()
    assert_close(loss.detach(), total, atol=1e-6, rtol=0)
    for (name, p), q in zip(split.named_parameters(), apart.parameters()):
        assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=name)
    whole = build_model(args)                       # the same batch routed whole: another capacity, another loss
    with whole.dropout_keys.training(0):
        assert abs(moe.plus_aux_loss(whole, F.cross_entropy(whole(x), y)).item() - loss.item()) > 1e-6
    moe.read_load(split), moe.read_load(apart)
    for a, b in zip(moe.moe_layers(split), moe.moe_layers(apart)):
        assert a.load.routed == [[sum(c) for c in zip(*b.load.routed)]] and a.load.dropped == [sum(b.load.dropped)]
