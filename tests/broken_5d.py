"""parallel_5d.py with one of its pitfalls put back: `broken_5d.py FAULT args...` patches FAULT in, then runs the
program. tests/test_5d.py runs each and checks that it no longer matches the baseline, so that the test of the
program guards each part (a test that still passed with the part broken would guard nothing)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root

import torch  # noqa: E402

import parallel_5d as p5  # noqa: E402
from mp.dropout import DropoutKeys  # noqa: E402


def edp_average(mesh_size):
    """Megatron #5956 / torchtitan #1551: the experts averaged over their edp ranks (/ D*C/N), not / D*C."""
    init = p5.ExpertGrads.__init__

    def wrong(self, *args):
        init(self, *args)
        self.ep_sum = 1
    p5.ExpertGrads.__init__ = wrong


def rank_order(_):
    """Per-rank counts: each rank's tokens taken as one run (rank-major), not interleaved sample by sample."""
    p5.in_order = lambda blocks: blocks.permute(0, 2, 3, 1, 4, 5).reshape(-1, *blocks.shape[-2:])

    def back(flat, shape):
        d, b, c, t, k, e = shape
        return flat.view(d, c, t, b, k, e).permute(0, 3, 1, 2, 4, 5)
    p5.from_order = back


def cp_head_unscaled(_):
    """The head's backward without the factor C: the cp-partial gradients end up / C after the dp x cp average."""
    p5._SumOverCP.backward = staticmethod(lambda ctx, grad: (grad, None))


def norm_every_ep_rank(_):
    """The dense weights counted in the norm on every ep rank (they are summed over the ep group)."""
    syncs = p5.gradient_syncs

    def wrong(model, runner, mesh, args):
        out = syncs(model, runner, mesh, args)
        runner.counted = lambda p: True
        return out
    p5.gradient_syncs = wrong


def contiguous_keys(_):
    """Dropout keyed by a replica-contiguous sample index (parallel_3d.py's), not the baseline's."""
    p5.MicrobatchMajorKeys = lambda seed, *rest: DropoutKeys(seed)


def aux_unscaled(_):
    """The load-balancing loss's share backpropagated as it is, not weighted D*C/M like the rest of the loss."""
    init = p5.FoldedMoE.__init__

    def wrong(self, *args):
        init(self, *args)
        self.scale = 1.0
    p5.FoldedMoE.__init__ = wrong


FAULTS = {f.__name__.replace("_", "-"): f for f in
          (edp_average, rank_order, cp_head_unscaled, norm_every_ep_rank, contiguous_keys, aux_unscaled)}

if __name__ == "__main__":
    FAULTS[sys.argv.pop(1)](None)
    torch.set_num_threads(1)
    p5.main(sys.argv[1:])
