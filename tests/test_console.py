"""The console's progress lines (mp.log.Progress): on the same steps in every program, so that a
baseline's console and a parallel run's compare line by line."""
from mp.log import Progress


def test_progress_lines_fall_on_the_same_steps_whatever_the_speed(capsys):
    """Issue 67, item 6: the lines were every 5 s, so the baseline and a parallel run printed different
    steps. Now every 20 steps of 300, and the last, fast or slow."""
    for step_time in (1e-4, 7.0):
        progress = Progress(300, enabled=True)
        for step in range(300):
            progress.update(step, 2.0, step_time, 64)
        steps = [int(line.split()[1]) for line in capsys.readouterr().out.splitlines()]
        assert steps == list(range(0, 300, 20)) + [299], (step_time, steps)
    Progress(300, enabled=False).update(0, 2.0, 1.0, 64)
    assert capsys.readouterr().out == ""
