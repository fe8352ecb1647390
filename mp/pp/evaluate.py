"""Evaluation through a pipeline: the test split, forwards only, on the runner of pipeline_microbatch.py
(the schedule is schedules.eval_actions); the last stage scores the logits (mp.loop.evaluate)."""
from mp.loop import evaluate
from mp.pp.schedules import eval_actions


def evaluate_pipeline(runner, pos, data, device, replica=None, scores=None):
    """[test loss, accuracy] on the device, unread (mp.loop.evaluate), on the last stage (the other stages'
    figures mean nothing). Every message has the shape both sides expect: evaluate() sends batches of one
    size per call.
    replica=(d, D, group): my replica's slice of each test batch, the sums added (mp.loop.evaluate).
    scores: mp.loop.evaluate's, for logits that are not whole (parallel_3d.py's vocabulary columns)."""
    def run(batches, score):
        inputs = [x.to(device) for x, _ in batches] if pos.is_first_stage else None
        runner.run(eval_actions(pos, len(batches)), inputs, score, len(batches[0][1]))
    return evaluate(data, device, run, replica=replica, scores=scores)
