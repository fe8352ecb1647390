"""Where a pipeline step's time goes, per rank and engine: cProfile over timed steps, split into
communication (c10d send/recv/wait), native compute (every other C++ call: matmuls, autograd,
allocation) and Python (time spent in Python functions themselves), with the Python call count.

    torchrun --standalone --nproc-per-node 4 -- benchmarks/profile_step.py --configs cnn:32:1f1b --out logs/bench/profile.json

The engines run one after another (not interleaved: cProfile would count the other's time), so read
the split, not the totals, across engines.

Before the profiled steps, as many unprofiled ones give each rank's CPU time a step: the process's
(every thread: gloo's I/O threads too; getrusage) and its main thread's (time.thread_time), beside
the wall time. With more ranks than cores a step can take no less than all ranks' CPU time over the
cores, so "cpu" is the figure to compare across engines there (docs/benchmarks.md, Overheads).
"""
import cProfile
import json
import os
import pstats
import resource
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from mp.dist import distributed  # noqa: E402
from mp.data import SyntheticData  # noqa: E402


def split(profile):
    stats = pstats.Stats(profile).stats      # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    comm = native = python = 0.0
    calls = 0
    for (file, _, name), (_, ncalls, tottime, _, _) in stats.items():
        if file == "~":
            if "c10d" in name or "distributed" in name:
                comm += tottime
            else:
                native += tottime
        else:
            python += tottime
            calls += ncalls
    return {"comm_s": comm, "native_s": native, "python_s": python, "python_calls": calls}


def cpu_seconds():
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime, time.thread_time(), time.perf_counter()


def profile_engine(step, batches, warmup, repeat):
    for k in range(warmup):
        step(*batches[k % len(batches)])
    dist.barrier()
    before = cpu_seconds()
    for k in range(repeat):                  # unprofiled: CPU and wall time a step
        step(*batches[k % len(batches)])
    after = cpu_seconds()
    cpu = {key: (b - a) / repeat for key, a, b in zip(("cpu_s", "main_thread_cpu_s", "wall_s"), before, after)}
    dist.barrier()
    profile = cProfile.Profile()
    profile.enable()
    for k in range(repeat):
        step(*batches[k % len(batches)])
    profile.disable()
    dist.barrier()
    return {**cpu, **{key: value / repeat for key, value in split(profile).items()}}     # per step


def main():
    args = bench.parse_args(["pipeline"] + sys.argv[1:])
    with distributed(args) as env:
        data = SyntheticData(args.seed)
        batches = [data.batch(s, args.batch_size) for s in range(4)]
        results = []
        for config in args.configs.split(","):
            model, m, schedule = config.split(":")
            margs = bench.model_args(args, model, schedule, int(m))
            pos = bench.pipeline_rank(env, schedule)
            engines = {"ours": bench.ours_pipeline(margs, env, pos)[0], "torch": bench.torch_pipeline(margs, env, pos)}
            for name, step in engines.items():
                mine = profile_engine(step, batches, args.warmup, args.repeat)
                every = [None] * env.world_size
                dist.all_gather_object(every, mine)
                results.append({"config": config, "engine": name, "per_rank": every})
                if env.rank == 0:
                    print(f"{config:20s} {name:13s} " + "  ".join(
                        f"r{r}: comm {1e3 * e['comm_s']:6.1f} native {1e3 * e['native_s']:6.1f} "
                        f"py {1e3 * e['python_s']:5.1f} ms {e['python_calls']:6.0f} calls" for r, e in enumerate(every)),
                        flush=True)
                    print(f"{'':20s} {'unprofiled':13s} wall {1e3 * every[0]['wall_s']:6.1f} ms, cpu all ranks "
                          f"{1e3 * sum(e['cpu_s'] for e in every):6.1f} ms  " + "  ".join(
                              f"r{r}: cpu {1e3 * e['cpu_s']:6.1f} (main thread {1e3 * e['main_thread_cpu_s']:6.1f}) ms"
                              for r, e in enumerate(every)), flush=True)
        if env.rank == 0:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
