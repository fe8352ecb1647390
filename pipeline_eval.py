"""Evaluation through a pipeline: the test split, forwards only, on the executor of
pipeline_microbatch.py (the schedule is schedules.eval_actions); the last stage scores the logits."""
import torch
import torch.nn.functional as F

from data import test_batches
from schedules import eval_actions


@torch.no_grad()
def evaluate(runner, pos, data, device, batch=500):
    """A forward-only pipeline over the whole test split; the last stage returns (loss, accuracy).
    Every message has the shape both sides expect: the full batches go through in one pass, a
    smaller last batch in a second pass of its own size."""
    batches, totals = test_batches(data, batch), [0.0, 0]
    full = [b for b in batches if len(b[1]) == len(batches[0][1])]
    for part in (full, batches[len(full):]):
        if not part:
            continue

        def head(mb, logits, part=part):
            labels = part[mb][1].to(device)
            totals[0] += F.cross_entropy(logits, labels, reduction="sum").item()
            totals[1] += (logits.argmax(1) == labels).sum().item()

        inputs = [bx.to(device) for bx, _ in part] if pos.is_first_stage else None
        runner.run(eval_actions(pos, len(part)), inputs, head, len(part[0][1]))
    n = sum(len(y) for _, y in batches)
    return totals[0] / n, totals[1] / n
