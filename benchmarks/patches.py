"""The fast path, as monkeypatches of our programs (this directory may not edit them).

bench.py --patched times a second copy of our engine with these applied, step by step between the
others, so that each patch's gain is a ratio measured in the same run. Each patch is the exact
change recommended for the program it names (docs/benchmarks.md, "Overheads").

1. pipeline_microbatch.Messenger.exchange waits only for its receives. A gloo send completes only
   once the peer has posted the matching receive, so waiting for it ties stage r's next forward to
   stage r+1 being ready: the pipeline runs in lock step, and GPipe's forwards cannot run ahead.
   The sends' works are kept (their tensors with them) and dropped once completed; StageRunner.run
   waits for the rest at the end of the step. Fewer waits cannot create a deadlock: every rank
   still posts the same messages in the same order, and posting never blocks. On nccl,
   batch_isend_irecv returns one work for the whole group, which is then waited as before.
2. The "wait ..." timeline label is built only while a timeline is recorded.
"""
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import pipeline_microbatch as pm

_original_run = pm.StageRunner.run


def exchange(self, parts, outbox, mb_size, record):
    """Messenger.exchange, waiting for receives only (patch 1)."""
    ops, inbox = [], {}
    for kind, peer, msg in parts:
        if kind == "send":
            tensor = outbox.pop(msg)
        else:
            tensor = inbox[msg] = torch.empty((mb_size, *self.shapes[msg[2] + (msg[0] == "grad")]),
                                              device=self.device)
        ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, None, self.tag(msg)))
    works = dist.batch_isend_irecv(ops) if ops else []
    start = time.perf_counter()
    sends = self.__dict__.setdefault("sends", [])
    per_op = len(works) == len(ops)                      # gloo: one work per op; nccl: one for the group
    for (kind, _, _), op, work in zip(parts, ops, works) if per_op else ():
        if kind == "send":
            sends.append((work, op.tensor))              # the tensor lives until its send completes
        else:
            wait(self, work, parts)
    for work in works if not per_op else ():
        wait(self, work, parts)
    self.sends = [(w, t) for w, t in sends if not w.is_completed()]
    if getattr(record, "__self__", None) is None or record.__self__.events is not None:   # patch 2
        record("wait", "wait " + " ".join(f"{k} {m[0]} mb{m[1]}" for k, _, m in parts), None, start)
    return inbox


def wait(messenger, work, parts):
    try:
        work.wait()
    except RuntimeError as e:
        raise pm.PipelineError(f"stage {messenger.pos.pp_rank} gave up waiting on {parts} (timeout "
                               f"{messenger.timeout_s:g} s): {str(e).splitlines()[0][:160]}") from None


def run(self, actions, inputs, head, mb_size):
    """StageRunner.run, then wait for the sends still in flight (patch 1)."""
    _original_run(self, actions, inputs, head, mb_size)
    for work, _ in self.messenger.__dict__.pop("sends", []):
        wait(self.messenger, work, "the last sends")


PATCHES = [(pm.Messenger, "exchange", exchange), (pm.StageRunner, "run", run)]


@contextmanager
def applied(patches=None):
    patches = PATCHES if patches is None else patches
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, new in patches:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


def wrap(step, patches=None):
    """step with the patches applied for the duration of each call (other engines run unpatched)."""
    def patched_step(x, y):
        with applied(patches):
            return step(x, y)
    return patched_step


# ----------------------------------------------------------------------------- tensor parallelism

import tensor_parallel as tp  # noqa: E402


def reduce_forward(ctx, x, group):
    """tensor_parallel._ReduceFromTP.forward without _all_reduce's defensive clone (patch 3): x is a
    fresh layer output that autograd does not keep (linear and conv save their inputs, not their
    output), so it can be summed in place. The clone stays in _CopyToTP.backward, whose incoming
    gradient may be shared."""
    if tp.tp_size(group) == 1 or not x.is_contiguous():
        return tp._all_reduce(x, group)
    dist.all_reduce(x, group=group)
    return x


TP_PATCHES = [(tp._ReduceFromTP, "forward", staticmethod(reduce_forward))]
