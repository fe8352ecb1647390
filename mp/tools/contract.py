"""What the equivalence contract says about each parallel run of a figure: every parallel program logs
the baseline's per-step training loss within 1e-4 (docs/equivalence.md).

A mixture of experts has one exception, and it is measured, not assumed: a near-tie between two
experts that float32 rounding tips the other way routes a token elsewhere, and from that step on the
two runs compute different functions (docs/expert_parallel.md). The summary record logs the routing
of every step (tokens per expert, per block), so the step where it first differs is read from the
logs; before it the run is held to the contract like any other, after it the difference is reported,
not judged. A run whose routing never differs, or that has none, is held to the contract at every step.
A breach is a result, not bad input: mp.tools.plot_curves draws the figure, then names the run and
the step on stderr and exits 1."""
from dataclasses import dataclass

TOLERANCE = 1e-4  # the equivalence contract: |loss - baseline loss| <= 1e-4 at every step
LIMIT = "1e-4"    # as the docs write it


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

    @property
    def holds(self):
        return self.breach is None


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
    return Verdict(label, len(pairs), largest, worst_step, parted, max((d for _, d in covered), default=0.0), breach)


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
            f"tipped by rounding: docs/expert_parallel.md)")


def breach_line(v):
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
    if broken:
        step, difference = broken[0].breach
        return (f"CONTRACT BROKEN: |loss - baseline| = {num(difference)} > {LIMIT} at step {step} "
                f"({broken[0].label})")
    parted = [v for v in judged if v.parted is not None]
    if not parted:
        return (f"largest |loss - baseline| = {num(max(v.largest for v in judged))}: within the contract "
                f"({LIMIT}) at every step")
    v = min(parted, key=lambda v: v.parted)
    return (f"exact to {num(max(v.before for v in judged))} (contract {LIMIT}) until routing first differs "
            f"at step {v.parted}; from then the runs part ({num(v.largest)} at step {v.worst_step}): "
            f"a near-tie between two experts")
