"""The B/W split of mp/pp/zero_bubble.py, layer by layer in one process: B gives the input gradient at
once, W gives the weight gradient later, and both equal autograd's on the plain layer."""
import copy

import pytest
import torch
import torch.nn as nn

from helpers import run_ranks
from mp.pp.zero_bubble import SplitConv2d, SplitLinear, SplitShardOp, split_weight_grads


def split_and_plain(layer):
    plain = copy.deepcopy(layer)
    chunk = nn.Sequential(layer)
    stash = split_weight_grads(chunk)
    return chunk, stash, plain


@pytest.mark.parametrize("layer,shape", [
    (nn.Linear(12, 5), (7, 12)),                                           # a batch of vectors
    (nn.Linear(8, 6), (3, 4, 8)),                                          # tokens: the vit's layers
    (nn.Linear(8, 6, bias=False), (5, 8)),
    (nn.Conv2d(3, 6, 5), (2, 3, 12, 12)),                                  # the cnn's
    (nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), (2, 4, 11, 9)),
])
def test_a_deferred_weight_gradient_equals_autograds(layer, shape):
    torch.manual_seed(0)
    chunk, stash, plain = split_and_plain(layer)
    assert type(chunk[0]) in (SplitLinear, SplitConv2d)
    for mb in range(3):                       # three microbatches accumulate, as in a pipeline step
        x = torch.randn(shape)
        x_split, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
        dy = torch.randn_like(plain(x))
        with stash.backward_of(mb):           # B
            torch.autograd.backward(chunk(x_split), dy)
        torch.autograd.backward(plain(x_plain), dy)
        torch.testing.assert_close(x_split.grad, x_plain.grad)
        if layer.bias is not None:            # small parameters take their gradient in B
            torch.testing.assert_close(layer.bias.grad, plain.bias.grad)
        before = None if layer.weight.grad is None else layer.weight.grad.clone()
        assert set(stash.pending) == {mb}
        stash.weight_grads(mb)                # W
        assert not stash.pending and (before is None or not torch.equal(before, layer.weight.grad))
        torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


def test_b_leaves_the_weight_gradient_to_w_and_keeps_no_graph():
    layer = nn.Linear(4, 3)
    chunk, stash, _ = split_and_plain(layer)
    x = torch.randn(2, 4, requires_grad=True)
    with stash.backward_of(0):
        chunk(x).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None and x.grad is not None
    (_, kept_x, kept_dy), = stash.pending[0]
    assert not kept_x.requires_grad and kept_x.grad_fn is None and kept_dy.grad_fn is None


def test_the_split_twin_keeps_the_parameters_and_evaluates_plainly():
    """The replacement holds the same parameter objects under the same names (the optimizer, the
    checkpoints and the full model's names see no change), and runs the plain op under no_grad."""
    block = nn.Sequential(nn.Linear(4, 3), nn.GELU(), nn.Sequential(nn.Conv2d(3, 2, 1)))
    before = dict(block.named_parameters())
    stash = split_weight_grads(block)
    assert [type(m) for m in (block[0], block[2][0])] == [SplitLinear, SplitConv2d]
    assert dict(block.named_parameters()) == before
    with torch.no_grad():
        block[0](torch.randn(2, 4))
    assert not stash.pending


def test_w_accumulates_through_autograd_so_gradient_hooks_fire():
    """Data parallelism's hooks see dA when W adds it, as they would in an unsplit backward."""
    layer = nn.Linear(4, 3)
    seen = []
    chunk, stash, plain = split_and_plain(layer)
    layer.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x = torch.randn(2, 4)
    with stash.backward_of(0):
        chunk(x).sum().backward()
    assert seen == []                         # B: no weight gradient yet
    stash.weight_grads(0)
    plain(x).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], layer.weight.grad)
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad)


def test_a_split_backward_outside_a_b_action_is_refused():
    chunk, stash, _ = split_and_plain(nn.Linear(4, 3))
    with pytest.raises(AssertionError, match="outside a B action"):
        chunk(torch.randn(2, 4, requires_grad=True)).sum().backward()


def test_b_computes_no_input_gradient_that_nothing_reads(monkeypatch):
    """The first stage's first layer reads the images: its B skips the input gradient (a whole
    conv-transpose, or a matmul of the largest layer, per microbatch) and still defers dA to W."""
    calls = []
    real = torch.nn.grad.conv2d_input
    monkeypatch.setattr(torch.nn.grad, "conv2d_input", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunk, stash, plain = split_and_plain(nn.Conv2d(3, 6, 5))
    x = torch.randn(2, 3, 12, 12)                              # an image batch: no requires_grad
    dy = torch.randn_like(plain(x))
    with stash.backward_of(0):
        torch.autograd.backward(chunk(x), dy)
    assert calls == []
    stash.weight_grads(0)
    torch.autograd.backward(plain(x), dy)
    torch.testing.assert_close(chunk[0].weight.grad, plain.weight.grad)
    x = x.requires_grad_()                                     # a later layer's input: B computes it
    with stash.backward_of(1):
        torch.autograd.backward(chunk(x), dy)
    assert calls == [1]


def test_a_tensor_parallel_shard_defers_its_weight_gradient_too(tmp_path):
    """parallel_3d.py's zb: column- and row-parallel Linear and Conv2d shards on 2 spawned ranks
    give autograd's input and weight gradients, the weight's only at W (B leaves it empty)."""
    run_ranks(_sharded_case, 2, tmp_path)


def _sharded_case(rank, world, group):
    import tensor_parallel as tp
    torch.manual_seed(0)
    cases = [(tp.ColumnParallelLinear, nn.Linear(6, 8), (5, None)),   # None: the shard's input width
             (tp.RowParallelLinear, nn.Linear(8, 4), (5, None)),
             (tp.ColumnParallelConv2d, nn.Conv2d(3, 4, 3, padding=1), (2, None, 6, 6)),
             (tp.RowParallelConv2d, nn.Conv2d(4, 2, 3, stride=2), (2, None, 7, 7))]
    for kind, full, shape in cases:
        layer, plain = kind(full, group), kind(full, group)                 # twins: the same slice of full
        chunk = nn.Sequential(layer)
        stash = split_weight_grads(chunk)
        assert isinstance(layer.op, SplitShardOp) and chunk[0] is layer      # the shard stays, its op splits
        x = torch.randn(shape[0], layer.weight.shape[1], *shape[2:])         # a row shard reads its slice of x
        x_split, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = chunk(x_split)
        dy = torch.randn_like(y)
        with stash.backward_of(0):
            torch.autograd.backward(y, dy)
        assert layer.weight.grad is None and stash.pending[0]
        stash.weight_grads(0)
        torch.autograd.backward(plain(x_plain), dy)
        torch.testing.assert_close(x_split.grad, x_plain.grad)
        torch.testing.assert_close(layer.weight.grad, plain.weight.grad)
        if layer.bias is not None:
            torch.testing.assert_close(layer.bias.grad, plain.bias.grad)


def test_w_of_a_weight_without_hooks_adds_in_place_without_autograd(monkeypatch):
    """The fast W: the step's first W sets A.grad, each later one adds dA into that same tensor (one
    GEMM into it, no temporary), and autograd's deferred function is never built."""
    import mp.pp.zero_bubble as zero_bubble
    built = []
    real = zero_bubble._DeferredWeightGrad.apply
    monkeypatch.setattr(zero_bubble._DeferredWeightGrad, "apply", lambda *a: built.append(1) or real(*a))
    torch.manual_seed(0)
    chunk, stash, plain = split_and_plain(nn.Linear(6, 4))
    grads = []
    for mb in range(3):
        x, dy = torch.randn(5, 6), torch.randn(5, 4)
        with stash.backward_of(mb):
            torch.autograd.backward(chunk(x), dy)
        stash.weight_grads(mb)
        torch.autograd.backward(plain(x), dy)
        grads.append(chunk[0].weight.grad)
        torch.testing.assert_close(chunk[0].weight.grad, plain.weight.grad)
    assert built == [] and grads[0] is grads[1] is grads[2]


def test_a_hook_on_the_gradient_sends_w_through_autograd():
    """Tensor.register_hook runs on dA before it is added: only autograd runs it, so W takes that
    path for a hooked weight (here the hook doubles dA, and A.grad is twice autograd's)."""
    torch.manual_seed(0)
    chunk, stash, plain = split_and_plain(nn.Linear(6, 4))
    chunk[0].weight.register_hook(lambda g: 2 * g)
    x, dy = torch.randn(5, 6), torch.randn(5, 4)
    for mb in range(2):
        with stash.backward_of(mb):
            torch.autograd.backward(chunk(x), dy)
        stash.weight_grads(mb)
        torch.autograd.backward(plain(x), dy)
    torch.testing.assert_close(chunk[0].weight.grad, 2 * plain.weight.grad)


def split_against_plain(chunk, x, mbs=2):
    """B then W of `mbs` microbatches on the split chunk, and the plain backward on a copy: the
    parameters' gradients (None where autograd gives none) and the outputs must be equal."""
    plain = copy.deepcopy(chunk)
    stash = split_weight_grads(chunk)
    for mb in range(mbs):
        out = chunk(x)
        torch.testing.assert_close(out, plain(x))
        with stash.backward_of(mb):
            out.square().sum().backward()
        plain(x).square().sum().backward()
    for mb in range(mbs):
        stash.weight_grads(mb)
    for (name, a), b in zip(chunk.named_parameters(), plain.parameters()):
        if b.grad is None:
            assert a.grad is None, f"{name}: autograd gives it no gradient, the split gave one"
        else:
            torch.testing.assert_close(a.grad, b.grad, msg=name)
    return stash


def test_a_bias_free_first_layer_on_the_images_still_gets_its_weight_gradient():
    """Stage 0's first layer reads the images (no gradient wanted) and has no bias: nothing else asks
    autograd for the op, which the anchor keeps in the graph (issue 43)."""
    torch.manual_seed(0)
    chunk = nn.Sequential(nn.Linear(6, 5, bias=False), nn.GELU(), nn.Linear(5, 3))
    stash = split_against_plain(chunk, torch.randn(4, 6))
    assert chunk[0].weight.grad is not None and len(stash.weights) == 2


def test_a_frozen_weight_is_left_alone():
    torch.manual_seed(0)
    chunk = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))
    chunk[2].weight.requires_grad_(False)
    stash = split_against_plain(chunk, torch.randn(4, 6, requires_grad=True))
    assert chunk[2].weight.grad is None and all(w is not chunk[2].weight for w in stash.weights)


def test_hooks_on_a_replaced_layer_keep_running():
    torch.manual_seed(0)
    chunk = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))
    calls = []
    chunk[0].register_forward_hook(lambda module, inputs, output: output * 2)   # changes the output
    chunk[2].register_forward_pre_hook(lambda module, inputs: calls.append("pre"))
    split_against_plain(chunk, torch.randn(4, 6, requires_grad=True))            # outputs equal: the hook ran
    assert type(chunk[0]) is SplitLinear and calls.count("pre") == 6             # 2 split + 4 plain forwards
