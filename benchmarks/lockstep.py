"""Separate torchruns that take turns step by step, so that their steps alternate a second apart and
whatever else the machine does meanwhile (a neighbour, the cores' clock, the kernel's scheduling) falls
on each engine alike.

benchmarks/data_axis.py times the engines of each pair so: their torchruns start at once, and before
every step each rank waits for its engine's turn on a TCPStore the driver holds (Lockstep). When every
rank of an engine has ended its step, the next engine's turn begins; the last engine hands it back to the
first, one step on. The first turn is given once every rank of every engine has asked for it, so that no
step shares the cores with another engine's set-up. Between its turns an engine's ranks sleep in that wait:
they hold their memory and use no CPU.

    ours:   step 0 |        | step 1 |        | step 2 |        | ...
    torch:         | step 0 |        | step 1 |        | step 2 | ...

A rank ends its engine's turn when it asks for the next one (Turn.next), not when the step's clock stops,
so what it does between two steps (our loop's log line every --log-every steps) stays inside its own
turn; after its last step it takes one more turn that does nothing (Turn.finish), so that no engine's
last step shares the cores with another engine's exit.

Run one after the other instead, a minute apart, the vit's --zero 0 / ddp step-time ratio ranged over
0.94-1.09 in 8 rounds on 2 cores; in lockstep over 1.01-1.03 in 6 (docs/benchmarks.md, 2026-11-29). What
lockstep adds: each step starts where another engine's left the caches, a cost every engine pays.
"""
import os
import resource
import signal
import subprocess
import time
from datetime import timedelta

import torch.distributed as dist

ENV = "DATA_AXIS_TURN"   # host:port:side:sides:ranks:name, given by the driver to every rank of a lockstep run
TIMEOUT_S = 900          # as long as the driver waits for a torchrun


class Turn:
    """A rank's side: next() before each step, finish() after the last. Each turn's span (the machine's
    monotonic clock, one for every process) and the CPU time the process and its main thread used in its
    turns: the engine's own, where the run's wall clock is every engine's."""

    def __init__(self, spec, timeout_s=TIMEOUT_S):
        host, port, side, sides, ranks, self.name = spec.split(":")
        self.side, self.sides, self.ranks, self.step = int(side), int(sides), int(ranks), 0
        self.timeout_s, self.finished, self.spans, self.cpu_s, self.main_cpu_s = timeout_s, False, [], 0.0, 0.0
        self.began = None                     # (clock, CPU, main thread's CPU) when my current turn began
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))

    @classmethod
    def from_env(cls):
        """The rank's Turn where the driver asked for lockstep, else None."""
        return cls(os.environ[ENV]) if os.environ.get(ENV) else None

    def next(self):
        """End my engine's turn of the step before (if any), then wait for its turn of the next step."""
        if self.step > 0:
            self.end(self.step - 1)
        elif self.store.add("ready", 1) == self.sides * self.ranks:   # every rank's set-up over: the first turn
            self.store.set("go/0/0", "")
        try:
            self.store.wait([f"go/{self.step}/{self.side}"])
        except (RuntimeError, OSError):       # DistStoreError: the timeout, or the driver gone
            raise SystemExit(f"error: {self.name} waited {self.timeout_s} s for its turn at step {self.step}: an "
                             "engine before it in the lockstep stopped (its own error says why)") from None
        self.began = (time.monotonic(), cpu_time(), time.thread_time())
        self.step += 1

    def end(self, step):
        began, cpu, main = self.began
        self.spans.append((began, time.monotonic()))
        self.cpu_s += cpu_time() - cpu
        self.main_cpu_s += time.thread_time() - main
        if self.store.add(f"done/{step}/{self.side}", 1) == self.ranks:   # my engine's last rank to end it
            side, step = (self.side + 1, step) if self.side + 1 < self.sides else (0, step + 1)
            self.store.set(f"go/{step}/{side}", "")

    def finish(self):
        """After the last step: one more turn, empty, then the next engine's."""
        if not self.finished:
            self.finished = True
            self.next()
            self.end(self.step - 1)


def cpu_time():
    """This process's CPU seconds so far, every thread's, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def engine_span(ranks_spans):
    """The seconds an engine's turns took, from every rank's spans: each turn from its first rank's start to
    its last rank's end."""
    return sum(max(e for _, e in turn) - min(b for b, _ in turn) for turn in zip(*ranks_spans))


class Lockstep:
    """The driver's side: the store the ranks' Turns meet on (the first turn is given once every rank of
    every engine has asked for it: no engine's step shares the cores with another's set-up)."""

    def __init__(self, timeout_s=TIMEOUT_S):
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))

    def spec(self, side, sides, ranks, name):
        """ENV's value for the ranks of engine `name`, side `side` of `sides`, `ranks` ranks."""
        return f"127.0.0.1:{self.store.port}:{side}:{sides}:{ranks}:{name}"


def wait_all(procs, timeout_s=TIMEOUT_S):
    """Wait for every process (subprocess.Popen) of a lockstep; the first that fails stops the others, which
    would wait for its turns until their timeout (SIGTERM: torchrun stops its ranks). None when all ended
    well, else (the index of the one that did not, why)."""
    deadline, failed = time.monotonic() + timeout_s, None
    while failed is None and any(p.poll() is None for p in procs):
        time.sleep(0.2)
        bad = [i for i, p in enumerate(procs) if p.poll()]
        if bad:
            failed = (bad[0], f"exit status {procs[bad[0]].returncode}")
        elif time.monotonic() > deadline:
            failed = (next(i for i, p in enumerate(procs) if p.poll() is None), f"still running after {timeout_s} s")
    if failed is None:
        bad = [i for i, p in enumerate(procs) if p.returncode]
        failed = (bad[0], f"exit status {procs[bad[0]].returncode}") if bad else None
    if failed is not None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return failed
