"""The mixture of experts' panel of a loss figure: each expert's share of the tokens per step, as the
first run that logged its routing (the baseline, where it has one) routed them, and where each other
run's routing first differs from it (mp.tools.contract)."""
from mp.tools.contract import differences, judge, routing


def program_of(records, default):
    return next((r.get("program", default) for r in records if r["event"] == "config"), default)


def expert_loads(runs):
    """[(label, summary)] of the runs whose summary has the mixture of experts' routing record."""
    summaries = [(label, next((r for r in recs if r["event"] == "summary"), {})) for label, recs in runs]
    return [(label, s) for label, s in summaries if s.get("tokens_per_expert")]


def draw_expert_load(ax, loads, runs):
    """Each expert's share of the routed choices per step (summed over the blocks; even: 1/E) in the
    first run that logged them (the baseline's, where it has them), and the share dropped over capacity.
    The title says whose routing is drawn and, for each other run, whether its routing is the same
    at every step or from which step it differs (mp.tools.contract: a near-tie tipped by rounding)."""
    label, first = loads[0]
    drawn = dict(runs)[label]
    table = routing(drawn)
    steps = sorted(table)
    per_step = [[sum(col) for col in zip(*table[s])] for s in steps]
    totals = [sum(step) for step in per_step]
    for e in range(len(per_step[0])):
        ax.plot(steps, [step[e] / t for step, t in zip(per_step, totals)], lw=1, label=f"expert {e}")
    ax.axhline(1 / len(per_step[0]), color="grey", lw=1, ls=":", label="even load (1/E)")
    if any(first.get("dropped_per_step", [])):
        ax.plot(steps, [d / t for d, t in zip(first["dropped_per_step"], totals)], color="black",
                ls="--", lw=1, label="dropped over capacity")
    same, parted, notes = [], {}, []
    for other, _ in loads[1:]:
        records = dict(runs)[other]
        verdict = judge(other, differences(drawn, records), drawn, records)
        name = program_of(records, other)
        if verdict.parted is None:
            same.append(other)
            notes.append(f"{name}: the same at every step")
            continue
        parted[other] = {"step": verdict.parted, "largest_difference_before": verdict.before}
        notes.append(f"{name}: the same until step {verdict.parted - 1}, differs from step {verdict.parted}")
        ax.axvline(verdict.parted, color="black", lw=1, ls="-.", label=f"{name}'s routing first differs")
    whose = program_of(drawn, label)
    ax.set(xlabel="step", ylabel="share of the tokens' expert choices",
           title="\n".join([f"tokens per expert, as {whose} routed them"] + notes[:2]))
    return {"drawn": label, "same_in": same, "first_differs": parted}
