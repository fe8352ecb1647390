"""Does a gloo send complete before its receive is posted? (No: wait() returns only once it is.)

    torchrun --standalone --nproc-per-node 2 -- benchmarks/gloo_send_wait.py

This is why pipeline_microbatch.Messenger.exchange waits only for its receives and waits for its sends
just before the next exchange that sends: waiting for a send at once would tie a stage's next
forward to its neighbour being ready to receive (docs/benchmarks.md, "Overheads", change 1).
"""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
for numel in (1_000, 131_072, 4_000_000):
    t = torch.ones(numel)
    dist.barrier()
    if dist.get_rank() == 0:
        start = time.perf_counter()
        work = dist.isend(t, 1)
        posted = time.perf_counter() - start
        work.wait()
        print(f"{4 * numel:>9} bytes: isend posted in {posted * 1e3:.2f} ms, wait() returned after "
              f"{time.perf_counter() - start:.3f} s (the receiver posted its recv after 1.000 s)", flush=True)
    else:
        time.sleep(1.0)
        dist.recv(t, 0)
dist.barrier()
os._exit(0)
