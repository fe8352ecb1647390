"""What the equivalence contract says about each parallel run of a figure: every parallel program logs
the baseline's per-step training loss within 1e-4 (docs/equivalence.md).

A mixture of experts has one exception, and it is measured, not assumed: a near-tie between two
experts that float32 rounding tips the other way routes a token elsewhere, and from that step on the
two runs compute different functions (docs/expert_parallel.md). The summary record logs the routing
of every step (tokens per expert, per block), so the step where it first differs is read from the
logs; before it the run is held to the contract like any other. After it the two runs train different
functions, and what can be held is that they train alike: their running means over WINDOW steps stay within
BAND of each other (a near-tie moves the loss by the 1e-3 of one token's route; a broken run leaves the band).
A run whose routing never differs, or that has none, is held to the contract at every step.
A breach is a result, not bad input: mp.tools.plot_curves draws the figure, then names the run and
the step on stderr and exits 1."""
from dataclasses import dataclass

TOLERANCE = 1e-4  # the equivalence contract: |loss - baseline loss| <= 1e-4 at every step
LIMIT = "1e-4"    # as the docs write it
WINDOW = 20       # after the routing parts: the steps of a running mean of each run's loss
BAND = 1e-2       # ... and how far apart the two running means may be


def num(x):
    """2.6e-4, not 2.6e-04; 0.0012 as 1.2e-3: the figures' and the docs' way of writing a difference."""
    return f"{x:.2g}" if x >= 0.01 or x == 0 else f"{x:.1e}".replace("e-0", "e-")


@dataclass
class Verdict:
    label: str
    steps: int                  # steps both runs logged
    largest: float              # the largest |loss - baseline| over them
    worst_step: int             # where it is
    parted: int = None          # the first step whose routing differs from the baseline's (None: never, or none)
    before: float = 0.0         # the largest difference before `parted` (every step where it is None)
    breach: tuple = None        # (step, difference): the first step over TOLERANCE that the contract covers
    note: str = ""              # what the reader should know about a breach (ReLU's kinks)
    band: float = None          # after `parted`: the largest difference of the WINDOW-step running means
    band_breach: tuple = None   # (step, difference): the first running-mean difference over BAND

    @property
    def holds(self):
        return self.breach is None and self.band_breach is None


def series(records, event, key):
    rows = [r for r in records if r["event"] == event]
    return [r["step"] for r in rows], [r[key] for r in rows]


def differences(base, records):
    """(steps, |loss - baseline loss|) over the steps both runs logged."""
    base_loss = dict(zip(*series(base, "train", "loss")))
    return [(s, abs(loss - base_loss[s])) for s, loss in zip(*series(records, "train", "loss")) if s in base_loss]


def first_step(records):
    """The step a run's routing record starts at: 0, or the step a resumed run restarted from (it logs
    the routing of the steps it trained itself)."""
    resumed = [r["step"] for r in records if r["event"] == "resume"]
    return resumed[-1] if resumed else 0


def routing(records):
    """{step: tokens per expert per block} from the summary record, or None for a dense run."""
    summary = next((r for r in records if r["event"] == "summary"), {})
    table = summary.get("tokens_per_expert")
    if not table:
        return None
    start = first_step(records)
    return {start + k: per_block for k, per_block in enumerate(table)}


def first_difference(base, other):
    """The first step both logged whose routing differs, or None."""
    a, b = routing(base), routing(other)
    if a is None or b is None:
        return None
    return next((step for step in sorted(set(a) & set(b)) if a[step] != b[step]), None)


def judge(label, pairs, base, records):
    """The verdict on one run from its (step, |loss - baseline|) pairs and both runs' records."""
    if not pairs:
        return Verdict(label, 0, float("nan"), -1)
    worst_step, largest = max(pairs, key=lambda p: p[1])
    parted = first_difference(base, records)
    covered = [(s, d) for s, d in pairs if parted is None or s < parted]
    breach = next(((s, d) for s, d in covered if d > TOLERANCE), None)
    v = Verdict(label, len(pairs), largest, worst_step, parted, max((d for _, d in covered), default=0.0), breach)
    if parted is not None:
        apart = running_differences(base, records, parted)
        v.band = max((d for _, d in apart), default=0.0)
        v.band_breach = next(((s, d) for s, d in apart if d > BAND), None)
    return v


def running_differences(base, records, start):
    """(step, |running mean of the loss - the baseline's|) from `start` on, each mean over the WINDOW steps up
    to the step (fewer at the first steps of a run)."""
    mine, theirs = dict(zip(*series(records, "train", "loss"))), dict(zip(*series(base, "train", "loss")))
    steps = sorted(s for s in mine if s in theirs)
    out = []
    for k, step in enumerate(steps):
        if step >= start:
            window = steps[max(0, k - WINDOW + 1):k + 1]
            out.append((step, abs(sum(mine[s] - theirs[s] for s in window) / len(window))))
    return out


def sentence(v):
    """One line on the console (and the launcher's last lines): what holds for this run."""
    if v.steps == 0:
        return f"{v.label}: no step in common with the baseline; nothing compared"
    if not v.holds:
        return breach_line(v)
    head = f"largest |loss - baseline| for {v.label}: {num(v.before)}"
    if v.parted is None:
        return f"{head} over all {v.steps} steps: the contract ({LIMIT}) holds"
    return (f"{head} until routing first differs at step {v.parted}: the contract ({LIMIT}) holds there; "
            f"from then the runs part, {num(v.largest)} at step {v.worst_step} (a near-tie between two experts, "
            f"tipped by rounding: docs/expert_parallel.md), their {WINDOW}-step running means within "
            f"{num(v.band)} (band {BAND:g})")


def breach_line(v):
    if v.breach is None:   # the running means after the routing parted
        step, difference = v.band_breach
        return (f"contract broken: {v.label}'s {WINDOW}-step running mean of the loss is {num(difference)} from the "
                f"baseline's at step {step}, over the band of {BAND:g} that holds after the routing first differs "
                f"(step {v.parted}): more than a near-tie's route apart")
    step, difference = v.breach
    why = ("no routing to explain it" if v.parted is None else
           f"the routing still the baseline's, which first differs at step {v.parted}")
    return (f"contract broken: {v.label} logged |loss - baseline| = {num(difference)} at step {step}, over the "
            f"{LIMIT} of the equivalence contract ({why}; largest {num(v.largest)} at step {v.worst_step})"
            + (f"; {v.note}" if v.note else ""))


def headline(verdicts):
    """The figure title's line: what holds, for the worst run."""
    judged = [v for v in verdicts if v.steps]
    if not judged:
        return ""
    broken = [v for v in judged if not v.holds]
    if broken and broken[0].breach is None:
        step, difference = broken[0].band_breach
        return (f"CONTRACT BROKEN: {WINDOW}-step running means {num(difference)} apart > {BAND:g} at step {step}, "
                f"after the routing parted ({broken[0].label})")
    if broken:
        step, difference = broken[0].breach
        return (f"CONTRACT BROKEN: |loss - baseline| = {num(difference)} > {LIMIT} at step {step} "
                f"({broken[0].label})")
    parted = [v for v in judged if v.parted is not None]
    if not parted:
        return (f"PASS: largest |loss - baseline| = {num(max(v.largest for v in judged))}: within the contract "
                f"({LIMIT}) at every step")
    v = min(parted, key=lambda v: v.parted)
    return (f"PASS: exact to {num(max(v.before for v in judged))} (contract {LIMIT}) until routing first differs "
            f"at step {v.parted};\nfrom then a near-tie's other route: the runs part ({num(v.largest)} at step "
            f"{v.worst_step}) and train alike ({WINDOW}-step means within {num(max(u.band for u in parted))}, "
            f"band {BAND:g})")   # two lines: the figure's width holds each
