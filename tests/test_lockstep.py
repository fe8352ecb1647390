"""benchmarks/lockstep.py: separate torchruns taking turns step by step (benchmarks/data_axis.py's timed runs).
The turns are taken here by threads standing for the ranks, on the driver's store; the failures by small
processes."""
import os
import subprocess
import sys
import threading
import time

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import lockstep  # noqa: E402


def test_engines_take_turns_step_by_step():
    """Two engines of two ranks each, three steps: every rank of an engine steps in the engine's turn, the
    engines' turns alternate (A's step 0, B's step 0, A's step 1...), and nobody steps before every rank has
    asked for its first turn (a rank late from its set-up holds the first turn back)."""
    lock, events, mutex = lockstep.Lockstep(timeout_s=30), [], threading.Lock()

    def rank(side, r):
        if side == 1 and r == 1:
            time.sleep(0.3)                          # a slow set-up
        turn = lockstep.Turn(lock.spec(side, 2, 2, f"engine{side}"), timeout_s=30)
        for step in range(3):
            turn.next()
            with mutex:
                events.append((side, step, "in"))
            time.sleep(0.01)
            with mutex:
                events.append((side, step, "out"))
        turn.finish()
        assert len(turn.spans) == 4 and turn.cpu_s >= 0 and turn.main_cpu_s >= 0

    threads = [threading.Thread(target=rank, args=(side, r)) for side in (0, 1) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # grouped by turn: both ranks of one engine in, both out, then the next engine's
    turns = [events[i:i + 4] for i in range(0, len(events), 4)]
    assert [(t[0][0], t[0][1]) for t in turns] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)], events
    for t in turns:
        assert {(s, k) for s, k, _ in t} == {t[0][:2]} and [e[2] for e in t] == ["in", "in", "out", "out"], t


def test_a_turn_not_given_is_one_error_line():
    """A rank whose turn never comes (an engine of its lockstep stopped, here in its set-up: it never asks)
    stops after its timeout with one error line naming its engine and step, not a hang."""
    lock = lockstep.Lockstep(timeout_s=5)
    waiting = lockstep.Turn(lock.spec(1, 2, 1, "ddp"), timeout_s=1)
    with pytest.raises(SystemExit, match=r"^error: ddp waited 1 s for its turn at step 0: an engine before it"):
        waiting.next()


def test_a_failed_run_stops_the_rest_of_its_lockstep():
    """wait_all: one process that fails stops the others (which would wait for its turns), and says which and why."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    start = time.monotonic()
    assert lockstep.wait_all([sleeper, failing], timeout_s=50) == (1, "exit status 3")
    assert sleeper.returncode is not None and time.monotonic() - start < 30
    both = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert lockstep.wait_all(both) is None
