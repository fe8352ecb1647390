"""Runs one program (COUNT_PROGRAM, a file in the repository root) with its arguments, counting on each
rank what its training steps read back from tensors (.item(), .tolist(), float(), bool()) and how many
all-reduces, reduce-scatters and all-gathers they start, and writes the counts to
COUNT_DIR/rank-<rank>.json when training ends.

A read is a tensor's value taken into Python (.item(), .tolist(), float(), int(), bool()) or an
operation whose output's size is data, which a GPU must report before the host goes on (nonzero,
bincount, repeat_interleave with tensor repeats and no output_size).

Counted: inside each step (the program's job.step) and inside the loop's reading of the logged
scalars (mp.loop.StepScalars.read): everything the training loop does between its set-up and its
summary, evaluation and checkpoints aside (the tests run without them).

SYNC_DEBUG=1 on a CUDA device also runs every step after the first under
torch.cuda.set_sync_debug_mode("error"): an operation inside a step that makes the CPU wait for the
GPU (a read, a blocking copy) then raises, naming it. The first step is left out: it sets the
device's libraries up (and mp.buckets counts its hooks' calls there).

A mixture of experts' one declared read (mp.moe.rows_per_expert, which the all-to-all's splits need)
is counted as a read and also as "declared_reads", and under SYNC_DEBUG it is let through: every other
wait on the device still raises.

Also written: "alive", the number of tensors alive (gc) after the 3rd and the 25th step, so that a
test sees whether anything the steps keep grows with the run."""
import gc
import json
import os
import runpy
import sys
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import mp.loop as loop  # noqa: E402
import mp.moe as moe  # noqa: E402

counts = {"steps": 0, "alive": {}, "reads": 0, "declared_reads": 0, "all_reduce": 0, "reduce_scatter": 0, "all_gather": 0,
          "broadcast": 0, "step_reads": 0, "step_all_reduce": 0, "step_reduce_scatter": 0, "step_all_gather": 0,
          "step_broadcast": 0}
counting = [False]


def counted(name, real, key):
    def wrapper(*args, **kwargs):
        if counting[0]:
            counts[key] += 1
            counts["step_" + key] += in_step[0]
        return real(*args, **kwargs)
    wrapper.__name__ = name
    return wrapper


in_step = [False]
SYNC_DEBUG = os.environ.get("SYNC_DEBUG") == "1" and torch.cuda.is_available()
for method in ("item", "tolist", "__float__", "__int__", "__bool__", "nonzero", "bincount"):
    setattr(torch.Tensor, method, counted(method, getattr(torch.Tensor, method), "reads"))
for name in ("nonzero", "bincount"):
    setattr(torch, name, counted(name, getattr(torch, name), "reads"))


def sized_by_data(real):
    """repeat_interleave counted as a read when its repeats are a tensor and no output_size is given."""
    def wrapper(input, repeats=None, *args, **kwargs):
        if counting[0] and isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            counts["reads"] += 1
            counts["step_reads"] += in_step[0]
        return real(input, repeats, *args, **kwargs)
    return wrapper


torch.repeat_interleave = sized_by_data(torch.repeat_interleave)
torch.Tensor.repeat_interleave = sized_by_data(torch.Tensor.repeat_interleave)
dist.all_reduce = counted("all_reduce", dist.all_reduce, "all_reduce")
dist.broadcast = counted("broadcast", dist.broadcast, "broadcast")   # mp.dp_collectives.all_gather's, on gloo
# ZeRO's and tensor parallelism's flat collectives (mp.dp_collectives binds them when the program imports it,
# after this; mp.tp.collectives takes them from there): torch 2.14's
# names and the older ones, each counted once (neither calls the other through torch.distributed)
for name, key in (("reduce_scatter_single", "reduce_scatter"), ("reduce_scatter_tensor", "reduce_scatter"),
                  ("all_gather_single", "all_gather"), ("all_gather_into_tensor", "all_gather")):
    if hasattr(dist, name):
        setattr(dist, name, counted(name, getattr(dist, name), key))


def around(fn, inside_step):
    def wrapper(*args, **kwargs):
        counting[0], in_step[0] = True, inside_step
        strict = inside_step and counts["steps"] > 1 and SYNC_DEBUG
        if strict:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            counting[0], in_step[0] = False, False
            if strict:
                torch.cuda.set_sync_debug_mode("default")
    return wrapper


def declared(real):
    """mp.moe.rows_per_expert: counted, and allowed to wait for the device (the programs import it after this)."""
    def wrapper(kept):
        counts["declared_reads"] += counting[0] and in_step[0]
        strict = SYNC_DEBUG and torch.cuda.get_sync_debug_mode() != 0
        if strict:
            torch.cuda.set_sync_debug_mode("default")
        try:
            return real(kept)
        finally:
            if strict:
                torch.cuda.set_sync_debug_mode("error")
    return wrapper


moe.rows_per_expert = declared(moe.rows_per_expert)
real_train, real_read = loop.train, loop.StepScalars.read
loop.StepScalars.read = around(real_read, inside_step=False)


def train(args, env, job):
    step = around(job.step, inside_step=True)

    def each(k):
        counts["steps"] += 1
        result = step(k)
        if counts["steps"] in (3, 25):
            gc.collect()
            with warnings.catch_warnings():   # isinstance() on every object touches torch's deprecated aliases
                warnings.simplefilter("ignore")
                counts["alive"][counts["steps"]] = sum(isinstance(o, torch.Tensor) for o in gc.get_objects())
        return result

    job.step = each
    status = real_train(args, env, job)
    with open(os.path.join(os.environ["COUNT_DIR"], f"rank-{env.rank}.json"), "w") as f:
        json.dump(counts, f)
    return status


loop.train = train
program = os.path.join(ROOT, os.environ["COUNT_PROGRAM"])
sys.argv = [program] + sys.argv[1:]
sys.path.insert(0, ROOT)
runpy.run_path(program, run_name="__main__")
