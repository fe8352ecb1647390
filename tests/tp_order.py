"""parallel_3d.py or parallel_5d.py with the tensor-parallel average of replicated gradients switched on, as on a
GPU (mp.replicas: on the CPU they are identical, so the programs skip it), and watched: `tp_order.py PROGRAM
args...`. The average writes into the very .grad views that the data-parallel buckets hold, so it must run
before any bucket holding those gradients has started its collective; otherwise two collectives read and
write one buffer at once (and under --zero 2 a bucket let go takes its parameters' .grad with it). A bucket
started too early ends the run with exit status 3 and a line naming the parameter (issue 82)."""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # the repository root

import mp.replicas  # noqa: E402
from mp.buckets import GradBuckets  # noqa: E402

started = set()          # the parameters whose bucket's collective has started in this step
start, zero_grad = GradBuckets.start, GradBuckets.zero_grad


def watched_start(self, b):
    started.update(id(p) for p in b.params)
    return start(self, b)


def watched_zero_grad(self, *args):
    started.clear()
    return zero_grad(self, *args)


class WatchedReplicatedGrads(mp.replicas.ReplicatedGrads):
    def average(self):
        early = [p for p in self.params if id(p) in started]
        if early:
            print(f"error: a data-parallel bucket holding a replicated gradient of shape {list(early[0].shape)} "
                  f"started before the tensor-parallel average wrote into it", file=sys.stderr, flush=True)
            os._exit(3)
        super().average()


GradBuckets.start, GradBuckets.zero_grad = watched_start, watched_zero_grad
mp.replicas.average_replicated_grads = lambda model, group, device: WatchedReplicatedGrads(model, group)
program, sys.argv = os.path.join(ROOT, sys.argv[1]), sys.argv[1:]
runpy.run_path(program, run_name="__main__")
