"""Runs one program (NCCL_RULE_PROGRAM, a file in the repository root) with its arguments on gloo, on
the paths it takes on nccl, with nccl's point-to-point rule enforced, and writes what it saw to
NCCL_RULE_DIR/rank-<rank>.json.

nccl's rule: a send and a receive that cross between two ranks must be posted in one group call
(dist.batch_isend_irecv); posted as separate dist.isend / dist.irecv calls, each is queued alone on
the rank's stream, and a receive queued ahead of the send its peer waits for blocks both for ever.
gloo forgives it, so a program can pass every CPU test and hang on a GPU (the context-parallel ring
did, issue 57). Here:

- mp.pp.p2p.nccl_rules is made true, so the pipeline's Messenger takes its nccl paths (no receive
  posted ahead, sends kept in flight, zbv's sends held back to their tick);
- dist.isend and dist.irecv raise unless dist.batch_isend_irecv is calling them, naming the call;
- dist.batch_isend_irecv returns one Work for the whole batch, as nccl's does.

What this cannot show: an order of batches that deadlocks nccl's stream (rank a's batch receives
from b before a later batch sends to b, and b's the same way round). The pipeline's plans are
checked for that by their dry run with blocking sends (tests/test_schedules.py); the ring posts each
tick's send and receive in one batch."""
import json
import os
import runpy
import sys

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import mp.pp.p2p as p2p  # noqa: E402

seen = {"batches": 0, "batched_ops": 0}
inside_batch = [False]
real_isend, real_irecv, real_batch = c10d.isend, c10d.irecv, c10d.batch_isend_irecv


class OneWork:
    """nccl's batch_isend_irecv returns one Work that stands for every operation of the batch."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for work in self.works:
            work.wait(timeout) if timeout is not None else work.wait()
        return True


def only_in_a_batch(real, name):
    def op(*args, **kwargs):
        if not inside_batch[0]:
            raise RuntimeError(f"nccl rule: dist.{name} called alone, outside dist.batch_isend_irecv (on nccl a "
                               f"send and a receive that cross must share one batch, or both block)")
        seen["batched_ops"] += 1
        return real(*args, **kwargs)
    op.__name__ = name
    return op


def batch_isend_irecv(ops):
    seen["batches"] += 1
    inside_batch[0] = True
    try:
        works = real_batch(ops)
    finally:
        inside_batch[0] = False
    return [OneWork(works)] if works else []


p2p.nccl_rules = lambda device: True
# P2POp checks its op against c10d's own isend and irecv, and batch_isend_irecv calls the op it holds:
# both the package's names and c10d's are replaced, so a P2POp made of either passes and is checked
checked_isend, checked_irecv = only_in_a_batch(real_isend, "isend"), only_in_a_batch(real_irecv, "irecv")
for module in (dist, c10d):
    module.isend, module.irecv, module.batch_isend_irecv = checked_isend, checked_irecv, batch_isend_irecv


def write_seen():
    if dist.is_initialized():
        with open(os.path.join(os.environ["NCCL_RULE_DIR"], f"rank-{dist.get_rank()}.json"), "w") as f:
            json.dump(seen, f)


real_destroy = dist.destroy_process_group


def destroy_process_group(*args, **kwargs):   # every program tears its group down after a clean run
    write_seen()
    return real_destroy(*args, **kwargs)


dist.destroy_process_group = destroy_process_group
program = os.path.join(ROOT, os.environ["NCCL_RULE_PROGRAM"])
sys.argv = [program] + sys.argv[1:]
runpy.run_path(program, run_name="__main__")
