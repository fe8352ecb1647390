"""The step reads nothing back from the device and communicates only what it must (issue 35): each
program's steps, counted on every rank by tests/count_reads.py. With --log-every 10 the loop reads
the steps' loss and norm once every 10 steps (on the rank that logs), so at most 0.3 reads a step;
a pipeline step without clipping starts no all-reduce (the norm's sums wait for the log); and a
data-parallel step's gradient all-reduces are one per bucket, however many microbatches it runs."""
import glob
import json

import pytest

from helpers import FAST, assert_same_losses, launch, slow

STEPS = ["--steps", "20", "--log-every", "10"]
PROGRAMS = {   # program, ranks, its flags
    "baseline": ("single_baseline.py", 1, []),
    "pipeline": ("pipeline_microbatch.py", 2, ["--schedule", "1f1b", "--microbatches", "4"]),
    "zb": ("pipeline_microbatch.py", 2, ["--schedule", "zb", "--microbatches", "4"]),
    "joint": ("pipeline_dp_joint.py", 4, ["--dp", "2", "--microbatches", "4", "--batch-size", "64"]),
    "tp": ("tensor_parallel.py", 2, []),
    "3d": ("parallel_3d.py", 4, ["--dp", "2", "--tp", "2", "--microbatches", "2", "--batch-size", "32"]),
}


def counted(tmp_path, monkeypatch, program, nproc, flags, steps=STEPS, run_too=False):
    """Each rank's counts (tests/count_reads.py) of a run of `program`; run_too: (counts, the run)."""
    monkeypatch.setenv("COUNT_PROGRAM", program)
    monkeypatch.setenv("COUNT_DIR", str(tmp_path))
    run = launch("tests/count_reads.py", FAST + steps + flags, tmp_path, nproc=nproc, log_name="log.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.load(open(path)) for path in sorted(glob.glob(str(tmp_path / "rank-*.json")))]
    n = int(steps[steps.index("--steps") + 1])
    assert len(ranks) == nproc and all(r["steps"] == n for r in ranks), ranks
    assert len(run.losses()) == n         # every step still lands in the log
    return (ranks, run) if run_too else ranks


@pytest.mark.parametrize("name", ["baseline", slow("pipeline"), "joint", slow("tp"), slow("zb"), slow("3d")])
def test_a_step_reads_nothing_back_and_the_log_reads_once_every_k_steps(name, tmp_path, monkeypatch):
    program, nproc, flags = PROGRAMS[name]
    ranks = counted(tmp_path, monkeypatch, program, nproc, flags)
    assert all(r["step_reads"] == 0 for r in ranks), ranks
    assert max(r["reads"] for r in ranks) / 20 <= 0.3, ranks
    assert max(r["reads"] for r in ranks) >= 2, ranks     # the logging rank reads, twice in 20 steps: counted
    if name in ("pipeline", "zb"):        # a pure pipeline: no all-reduce in a step, the norm's sum when logged
        assert all(r["step_all_reduce"] == 0 for r in ranks) and all(r["all_reduce"] == 2 for r in ranks), ranks


def test_clipping_sums_the_norm_in_the_step_without_reading_it(tmp_path, monkeypatch):
    program, nproc, flags = PROGRAMS["pipeline"]
    ranks = counted(tmp_path, monkeypatch, program, nproc, flags + ["--clip-grad-norm", "0.5"])
    assert all(r["step_reads"] == 0 for r in ranks) and all(r["step_all_reduce"] == 20 for r in ranks), ranks


@pytest.mark.parametrize("zero", [0, slow(1)])
def test_data_parallel_all_reduces_do_not_grow_with_the_microbatches(zero, tmp_path, monkeypatch):
    """The joint program's gradient collectives, at 2 and at 8 microbatches: one per bucket a step,
    started during the last backward; all-reduces, or with --zero 1 a reduce-scatter (the gradients; on
    gloo an all-reduce in place) and an all-gather (the updated parameters; on gloo D broadcasts). Each kind is counted."""
    program, nproc, _ = PROGRAMS["joint"]
    per_m = {}
    for m in (2, 8):
        folder = tmp_path / f"m{m}"
        folder.mkdir()
        ranks = counted(folder, monkeypatch, program, nproc, ["--dp", "2", "--microbatches", str(m),
                                                              "--batch-size", "64", "--zero", str(zero)])
        per_m[m] = [(r["step_all_reduce"], r["step_reduce_scatter"], r["step_all_gather"], r["step_broadcast"])
                    for r in ranks]
    assert per_m[2] == per_m[8], per_m
    # the cnn's stages: one bucket each, so 20 steps make 20 of each collective the step uses; on gloo
    # --zero 1's reduce-scatter is an all-reduce of the bucket in place and its all-gather a broadcast from
    # each of the 2 replicas (mp.buckets: gloo's own would copy the bucket)
    assert all(n == ((20, 0, 0, 40) if zero else (20, 0, 0, 0)) for n in per_m[2]), per_m


def test_the_timeline_shows_the_bucket_all_reduces_overlapping_the_last_backward(tmp_path):
    """Item 4's overlap, seen where a student would look: the joint program's --timeline (replica 0, the
    last step, after the first has counted the accumulations). A chunk's buckets start once its last B
    and that B's Ws have run (mp.buckets: said final, never inferred), in the exchange that sends the
    B's gradient on. Interleaved, 2 stages of an mlp of 1024-wide layers, a bucket per layer (closed
    once it holds 4 MB): stage 0's later chunk (layer 3) ends its backward first, so its bucket's
    all-reduce starts while stage 0 still waits for and runs its first chunk's last backward (layer 1,
    the step's last). No bucket starts before the step's first W: a chunk is final only once its Ws
    have run."""
    trace = tmp_path / "t.json"
    run = launch("pipeline_dp_joint.py", FAST + ["--dp", "2", "--model", "mlp", "--layers", "4", "--hidden", "1024",
                                                  "--steps", "3", "--batch-size", "16", "--microbatches", "2",
                                                  "--schedule", "interleaved", "--timeline", str(trace)],
                 tmp_path, nproc=4)
    assert run.returncode == 0, run.stderr[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    for stage in (0, 1):
        mine = [e for e in events if e.get("pid") == stage]
        buckets = sorted((e for e in mine if e["cat"] == "collective"), key=lambda e: e["ts"])
        # closed once it holds 4 MB, last layer first: stage 0 [b3 W3] [b1 W1], stage 1 [b4 W4 b2 W2]
        assert len(buckets) == {0: 2, 1: 1}[stage], buckets
        assert all(e["tid"] == 1 and e["name"].startswith("all-reduce") for e in buckets), buckets
        first_w = min(e["ts"] for e in mine if e["cat"] == "weight")
        assert buckets[0]["ts"] > first_w, (stage, buckets, first_w)
    stage0 = [e for e in events if e.get("pid") == 0]
    last_backward = max((e for e in stage0 if e["cat"] == "backward"), key=lambda e: e["ts"])
    assert last_backward["args"]["chunk"] == 0, last_backward          # layer 1's, the step's last
    started = [e["ts"] for e in stage0 if e["cat"] == "collective"]
    assert sum(ts < last_backward["ts"] for ts in started) == 1, (started, last_backward)   # [b3 W3]


def test_a_run_with_many_buckets_gives_the_baselines_losses(tmp_path, baseline):
    """The buckets' losses where there are several per stage (an mlp of 1024-wide layers: a bucket a
    layer), started while the backward runs, against the baseline step by step."""
    args = FAST + ["--model", "mlp", "--layers", "4", "--hidden", "1024", "--steps", "4", "--batch-size", "16"]
    run = launch("pipeline_dp_joint.py", args + ["--dp", "2", "--microbatches", "2", "--schedule", "1f1b"],
                 tmp_path, nproc=4)
    assert_same_losses(run, baseline(args))


MOE = ["--model", "vit", "--hidden", "16", "--heads", "4", "--layers", "2", "--batch-size", "8", "--experts", "4"]
MOE_STEPS = ["--steps", "26", "--log-every", "11"]   # logged after steps 11 and 22: 3 pending after the 3rd and 25th


@pytest.mark.parametrize("program,nproc,flags", [
    ("expert_parallel.py", 2, ["--top-k", "1"]),
    ("expert_parallel.py", 2, ["--top-k", "2", "--capacity-factor", "1.25"]),
    ("single_baseline.py", 1, ["--top-k", "2", "--capacity-factor", "1.25"])], ids=["ep-top1", "ep-top2-capacity",
                                                                                    "baseline-top2-capacity"])
def test_a_mixture_of_experts_reads_once_a_layer_and_keeps_nothing_per_step(program, nproc, flags, tmp_path,
                                                                            monkeypatch):
    """Issue 65: a MoE layer reads the device once a forward (the rows per expert, which split() and the
    all-to-all take as ints), capacity and top-2 included, and its routing record stays one buffer on the
    device until the loop logs: the tensors alive after the 3rd and the 25th step differ by at most 2."""
    ranks, run = counted(tmp_path, monkeypatch, program, nproc, MOE + flags, MOE_STEPS, run_too=True)
    layers = 2                       # one forward a step, no microbatches: one read a layer a step
    assert all(r["step_reads"] == layers * 26 for r in ranks), [r["step_reads"] for r in ranks]
    assert all(r["declared_reads"] == r["step_reads"] for r in ranks), ranks   # each read is mp.moe.rows_per_expert
    assert all(abs(r["alive"]["25"] - r["alive"]["3"]) <= 2 for r in ranks), [r["alive"] for r in ranks]
    summary = run.events("summary")[0]           # the routing record still whole: every step, every block
    assert len(summary["tokens_per_expert"]) == 26 and len(summary["tokens_per_expert"][0]) == layers
