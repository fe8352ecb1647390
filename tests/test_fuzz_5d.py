"""A layout fuzzer for parallel_5d.py (issue 82): each draw is a legal 5-D layout (dp, cp, tp, ep, the schedule,
--zero, sequence parallelism, ring or Ulysses, recompute, experts, top-k, capacity, microbatches, the bucket cap,
a balance), taken from a seed, run and compared with single_baseline.py --microbatches M step by step (loss and
gradient norm within 1e-6, the same tokens routed and dropped). A hand-picked list (tests/test_5d.py) finds what
its author thought of; a draw finds the rest (DESIGN.md, the equivalence contract's point 10).

The seed is new every run (from the OS), so the suite keeps looking; it is printed (pytest -s) and named in every
failure, with the one command that reruns the draw:

    MP_FUZZ_SEED=1234 python -m pytest -q tests/test_fuzz_5d.py -k draw3

Draw i of seed s depends on (s, i) alone. The quick subset draws 2 layouts on 2 or 4 ranks; the slow set
MP_FUZZ_DRAWS more (default 2) on 4 or 8 ranks. A draw is legal when the programs' own parsers take it
(mp.cli.parallel_5d_args at its WORLD_SIZE, and baseline_args), checked here in-process; a refused one is drawn
again."""
import contextlib
import io
import os
import random
import shlex

import pytest

from helpers import FAST, launch, slow
from mp.cli import baseline_args, parallel_5d_args

SEED = int(os.environ.get("MP_FUZZ_SEED") or int.from_bytes(os.urandom(4), "little"))
QUICK_DRAWS, SLOW_DRAWS = 2, int(os.environ.get("MP_FUZZ_DRAWS", 2))
TRIES = 1000          # redraws of a refused layout before the fuzzer gives up (a bug of the fuzzer, then)
STEPS = 3
# what every draw shares with its baseline: the vit of tests/test_5d.py, dropout and (active) clipping
RUN = FAST + ["--model", "vit", "--hidden", "16", "--heads", "4", "--layers", "2", "--batch-size", "8",
              "--dropout", "0.1", "--clip-grad-norm", "0.5", "--steps", str(STEPS)]
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb", "zbv"]   # not 2bw: parallel_5d.py refuses it
BLOCKS = 4            # the vit's --layers 2 blocks, its embedding and its head


def divisors(n):
    return [k for k in range(1, n + 1) if n % k == 0]


def pick(rng, flag, values):
    """--flag v for a v drawn from values, or nothing where v is None."""
    value = rng.choice(values)
    return [] if value is None else [flag, str(value)]


def coin(rng, flag, when=True):
    return [flag] if when and rng.random() < 0.5 else []


def draw_model(rng):
    """The flags the baseline shares: the optimizer, the experts and how they route, the microbatches."""
    model = ["--optimizer", rng.choice(["sgd", "adamw"]), "--microbatches", str(rng.choice([1, 2, 4]))]
    if rng.random() < 0.5:
        capacity = rng.choice([None, 1.0, round(rng.uniform(1.0, 2.0), 2)])
        model += ["--experts", "4", "--top-k", str(rng.choice([1, 2]))]
        model += [] if capacity is None else ["--capacity-factor", str(capacity)]
    return model


def draw_balance(rng, chunks):
    """Blocks per chunk: even (omitted) two times in three, else a random split of the 4 blocks."""
    if chunks > BLOCKS or chunks == 1 or rng.random() < 2 / 3:
        return []
    cuts = sorted(rng.sample(range(1, BLOCKS), chunks - 1))
    return ["--balance", ",".join(str(b - a) for a, b in zip([0] + cuts, cuts + [BLOCKS]))]


def meshes(world):
    """Every (stages, dp, cp, tp) that tiles the world with at most one chunk a block; from 4 ranks on, those that
    split at least two axes (one alone is tests/test_*.py's)."""
    tilings = [(world // (d * c * t), d, c, t) for d in divisors(world) for c in divisors(world // d)
               for t in divisors(world // (d * c)) if world // (d * c * t) <= BLOCKS]
    return [m for m in tilings if world < 4 or sum(k > 1 for k in m) >= 2]


def draw_layout(rng, world, experts):
    """The 5-D program's own flags: the mesh, the schedule and everything it may run with."""
    stages, d, c, t = rng.choice(meshes(world))
    schedule = rng.choice(SCHEDULES)
    layout = ["--dp", str(d), "--cp", str(c), "--tp", str(t), "--schedule", schedule]
    if experts:   # ep over dp x cp today, over dp x cp x tp once it folds over tp too: the parser judges
        layout += ["--ep", str(rng.choice(divisors(d * c * t)))]
    zero = rng.choice([0, 1, 2, 3]) if d * c > 1 else 0
    layout += ["--zero", str(zero)] + (pick(rng, "--zero3-gather", [None, "step", "microbatch"]) if zero == 3 else [])
    layout += coin(rng, "--sequence-parallel", t > 1) + coin(rng, "--no-scatter-gather", t > 1)
    layout += pick(rng, "--attention", ["ring", "ulysses"]) if c > 1 else []
    layout += coin(rng, "--recompute") + pick(rng, "--bucket-mb", [None, 0.002, 0.01])   # qkv: 3 KB
    return layout + draw_balance(rng, stages * (2 if schedule in ("interleaved", "zbv") else 1))


@contextlib.contextmanager
def ranks(world):
    """WORLD_SIZE as torchrun gives each rank (rank 0's view), the parser's `error:` line kept off the console."""
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ.update(WORLD_SIZE=str(world), RANK="0")
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def legal(parse, argv, world):
    """Whether the program's parser takes argv at this world size (it exits 2 with one line if not)."""
    with ranks(world):
        try:
            parse(argv, "fuzz")
        except SystemExit:
            return False
    return True


def draw(seed, index):
    """(world, layout, model) of draw `index` of `seed`: a function of the two alone."""
    rng = random.Random(f"parallel_5d fuzz {seed} {index}")
    worlds = [2, 4, 4] if index < QUICK_DRAWS else [4, 8]   # more axes at 4 ranks than at 2
    for _ in range(TRIES):
        world = rng.choice(worlds)
        model = draw_model(rng)
        layout = draw_layout(rng, world, "--experts" in model)
        if legal(parallel_5d_args, RUN + model + layout, world) and legal(baseline_args, RUN + model, 1):
            return world, layout, model
    raise AssertionError(f"seed {seed}, draw {index}: no legal layout in {TRIES} tries (the fuzzer's bug)")


def commands(seed, index, world, layout, model):
    """How to rerun a draw: through this test, or the two programs by hand."""
    return (f"rerun: MP_FUZZ_SEED={seed} python -m pytest -q tests/test_fuzz_5d.py -k draw{index}\n"
            f"  by hand: torchrun --standalone --nproc-per-node {world} "
            f"{shlex.join(['parallel_5d.py'] + RUN + model + layout)}\n"
            f"           python {shlex.join(['single_baseline.py'] + RUN + model)}")


def differences(run, reference):
    """What differs between the run and its baseline: a list of lines, empty where they match."""
    for name, r in (("parallel_5d.py", run), ("single_baseline.py", reference)):
        if r.returncode:
            return [f"{name} exited {r.returncode}:", r.stderr[-3000:]]
    got, want = run.events("train"), reference.events("train")
    if len(got) != len(want) or len(got) != STEPS:
        return [f"{len(got)} steps logged, the baseline {len(want)}, of {STEPS}"]
    wrong = [f"step {a['step']}: {key} {a[key]!r} vs the baseline's {b[key]!r} ({abs(a[key] - b[key]):.3g} apart)"
             for a, b in zip(got, want) for key in ("loss", "grad_norm") if not abs(a[key] - b[key]) <= 1e-6]
    if any(e.get("tokens_per_expert") is not None for e in reference.events("summary")):
        mine, base = run.events("summary")[0], reference.events("summary")[0]
        wrong += [f"{key}: {mine.get(key)} vs the baseline's {base[key]}" for key in
                  ("tokens_per_expert", "dropped_per_step") if mine.get(key) != base[key]]
    return wrong


@pytest.mark.parametrize("index", list(range(QUICK_DRAWS)) +
                         [slow(i) for i in range(QUICK_DRAWS, QUICK_DRAWS + SLOW_DRAWS)], ids="draw{}".format)
def test_a_drawn_layout_matches_the_baseline(tmp_path, baseline, index):
    world, layout, model = draw(SEED, index)
    said = f"fuzz seed {SEED}, draw {index}: {world} ranks {' '.join(layout + model)}"
    print(said)   # pytest -s
    run = launch("parallel_5d.py", RUN + model + layout, tmp_path, nproc=world)
    wrong = differences(run, baseline(RUN + model))
    assert not wrong, "\n".join([said] + wrong + [commands(SEED, index, world, layout, model)])
