"""Our schedules (mp/pp/schedules.py) checked by torch.distributed.pipelining's own schedule checker,
an independent oracle. Each rank's compute actions, as pipeline_microbatch.py's executor plays them,
become torch's actions ("stage kind microbatch": "1F3" is virtual stage 1's forward of microbatch 3,
"1B3" its full backward, zb's and zbv's split backward "1I3" (input gradient) and "1W3" (weight gradient);
interleaved's virtual stage is chunk * p + rank, on rank stage % p; zbv's V puts chunk 1 of rank r at 2p-1-r,
torch's generate_stage_to_rank_mapping(style="v"), and the checks get that map), and torch then
  _validate_schedule       every stage runs each microbatch's F, and its B (or I, then W) after it
  _add_send_recv           torch's own sends and receives between those compute orders (raises when
                           the ranks' orders wait on each other: a deadlock in the schedule itself)
  _simulate_comms_compute  plays the ranks against each other; raises when they stop progressing.
Our own messages (the executor's "comm" actions) go through the simulation too; it pairs a receive
with its send by name, as gloo's tags do (tests/test_nccl_order.py checks nccl's pairing by order).
These functions are torch's private API: a torch without one skips the test that needs it, saying which."""
import pytest
import torch

from mp.pp.schedules import compute_units, placement_of, schedule_actions, stage_owner, virtual_stage
from pipeline_microbatch import PipelineRank

PRIVATE = ("_Action", "_ComputationType", "_validate_schedule", "_add_send_recv", "_simulate_comms_compute")
CASES = {   # (p, m, v) each schedule accepts (mp.pp.flags): p 2-8, m 1-16
    "gpipe": [(p, m, 1) for p in range(2, 9) for m in range(1, 17)],
    "1f1b": [(p, m, 1) for p in range(2, 9) for m in range(1, 17)],
    "zb": [(p, m, 1) for p in range(2, 9) for m in range(1, 17)],
    "interleaved": [(p, m, v) for p in range(2, 9) for m in range(p, 17, p) for v in (2, 3)],
    "zbv": [(p, m, 2) for p in range(2, 9) for m in range(2, 17)],
}


def torch_v_mapping(p, stages):
    """torch's stage -> rank map of its V schedules (ScheduleZBVZeroBubble, DualPipeV), or a skip."""
    try:
        from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    except ImportError as e:
        pytest.skip(f"torch {torch.__version__} has no generate_stage_to_rank_mapping ({e})")
    return generate_stage_to_rank_mapping(p, stages, style="v")


def torch_private(*names):
    """torch.distributed.pipelining.schedules' private names, or a skip that names what is missing."""
    try:
        import torch.distributed.pipelining.schedules as schedules
    except ImportError as e:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.pipelining ({e})")
    missing = [name for name in names if not hasattr(schedules, name)]
    if missing:
        pytest.skip(f"torch {torch.__version__} lacks torch.distributed.pipelining.schedules."
                    f"{', '.join(missing)} (private API)")
    return [getattr(schedules, name) for name in names]


def played(schedule, p, m, v):
    """{rank: the actions its executor plays in one step}, messages included (mp.pp.schedules)."""
    return {r: schedule_actions(schedule, PipelineRank(r, p, list(range(p)), v, placement=placement_of(schedule)), m)
            for r in range(p)}


def as_torch(schedule, p, rank, compute):
    """Our compute actions (kind, microbatch, chunk) of one rank as torch's _Action, by its own parser."""
    Action, = torch_private("_Action")
    kinds = {"F": "F", "B": "I" if schedule in ("zb", "zbv") else "B", "W": "W"}   # zb's B: the input gradient only
    return [Action.from_str(f"{virtual_stage(chunk, rank, p, placement_of(schedule))}{kinds[kind]}{mb}")
            for kind, mb, chunk in compute]


def compute_only(all_actions, schedule, p):
    return {r: as_torch(schedule, p, r, [a for a in actions if a[0] != "comm"]) for r, actions in all_actions.items()}


def messages_as_torch(schedule, p, all_actions):
    """Our actions with their messages in torch's format: a message (what, microbatch, receiver's
    virtual stage s) is SEND_F of stage s-1 and RECV_F of s for an activation, SEND_B of s+1 and RECV_B
    of s for a gradient. An exchange posts its parts at once and waits for the receives only, so its
    sends come first (torch's simulated sends never block)."""
    Action, Kind = torch_private("_Action", "_ComputationType")
    ops = {("send", "act"): (Kind.SEND_F, -1), ("recv", "act"): (Kind.RECV_F, 0),
           ("send", "grad"): (Kind.SEND_B, +1), ("recv", "grad"): (Kind.RECV_B, 0)}
    out = {}
    for r, actions in all_actions.items():
        out[r] = []
        for action in actions:
            if action[0] != "comm":
                out[r] += as_torch(schedule, p, r, [action])
                continue
            for kind, _, (what, mb, stage) in sorted(action[1], key=lambda part: part[0] != "send"):
                op, shift = ops[(kind, what)]
                out[r].append(Action(stage + shift, op, mb))
    return out


def torch_check(schedule, p, m, v, all_actions):
    """Every check torch has, on one schedule; raises the first one's error."""
    validate, add_send_recv, simulate = torch_private("_validate_schedule", "_add_send_recv",
                                                      "_simulate_comms_compute")
    stages, placement = p * v, placement_of(schedule)
    stage_to_rank = lambda stage: stage_owner(stage, p, placement)[0]    # noqa: E731
    compute = compute_only(all_actions, schedule, p)
    mapping = validate(compute, p, stages, m)
    assert mapping == {s: stage_to_rank(s) for s in range(stages)}, mapping
    if placement == "v":                                                  # torch's own V, where it has one
        assert mapping == torch_v_mapping(p, stages), mapping
    with_comms = add_send_recv({r: list(a) for r, a in compute.items()}, stage_to_rank, stages)   # it consumes
    simulate(with_comms, stage_to_rank, stages)
    simulate(messages_as_torch(schedule, p, all_actions), stage_to_rank, stages)


def test_zbv_with_its_sends_at_once_passes_torchs_schedule_checker():
    """zbv's plan on gloo (schedule_actions(..., sends_at_once=True), mp.pp.p2p: each send right after its
    compute): torch's simulator, whose sends never block as that executor's do not, plays it too."""
    torch_private(*PRIVATE)
    failures = []
    for p, m, v in CASES["zbv"]:
        plans = {r: schedule_actions("zbv", PipelineRank(r, p, list(range(p)), v, placement="v"), m, sends_at_once=True)
                 for r in range(p)}
        try:
            torch_check("zbv", p, m, v, plans)
        except (AssertionError, ValueError, RuntimeError) as e:
            failures.append(f"p={p} m={m}: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert not failures, f"{len(failures)} zbv plans rejected:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("schedule", sorted(CASES))
def test_every_schedule_passes_torchs_schedule_checker(schedule):
    torch_private(*PRIVATE)
    failures = []
    for p, m, v in CASES[schedule]:
        try:
            torch_check(schedule, p, m, v, played(schedule, p, m, v))
        except (AssertionError, ValueError, RuntimeError) as e:
            failures.append(f"p={p} m={m} v={v}: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert not failures, f"{len(failures)} of {len(CASES[schedule])} {schedule} cases rejected:\n" + \
        "\n".join(failures[:20])
    assert len(CASES[schedule]) >= 50


def test_2bw_two_steps_pass_torchs_schedule_checker():
    """2bw's two steps as one schedule of 2m microbatches (the second step's numbered m .. 2m-1): its
    first step warms up and does not drain, the second drains; every F still comes before its B."""
    validate, add_send_recv, simulate = torch_private(*PRIVATE[2:])
    for p in range(2, 9):
        for m in range(p, 17):
            compute = {r: as_torch("2bw", p, r, [a for unit in compute_units("2bw", p, m, r) for a in unit])
                       for r in range(p)}
            validate(compute, p, p, 2 * m)
            simulate(add_send_recv(compute, lambda s: s, p), lambda s: s, p)


def swap_first(actions, kind_a, kind_b, mb):
    """Move the action (kind_b, mb) to just before (kind_a, mb), both of chunk 0."""
    actions.remove((kind_b, mb, 0))
    actions.insert(actions.index((kind_a, mb, 0)), (kind_b, mb, 0))


def test_torch_rejects_a_backward_before_its_forward():
    """The translation can fail: rank 1 of 1f1b (p=2, m=3) running B2 before F2 is refused."""
    validate, = torch_private("_validate_schedule")
    actions = played("1f1b", 2, 3, 1)
    compute = [a for a in actions[1] if a[0] != "comm"]
    swap_first(compute, "F", "B", 2)
    bad = {0: compute_only(actions, "1f1b", 2)[0], 1: as_torch("1f1b", 2, 1, compute)}
    with pytest.raises(AssertionError, match="stage 1, microbatch 2 without first running Forward"):
        validate(bad, 2, 2, 3)


def test_torch_rejects_a_weight_gradient_before_its_input_gradient():
    validate, = torch_private("_validate_schedule")
    actions = played("zb", 3, 4, 1)
    compute = [a for a in actions[2] if a[0] != "comm"]
    swap_first(compute, "B", "W", 0)
    bad = compute_only(actions, "zb", 3)
    bad[2] = as_torch("zb", 3, 2, compute)
    with pytest.raises(AssertionError, match="Backward Weight for stage 2, microbatch 0 without first running"):
        validate(bad, 3, 3, 4)


def test_torch_rejects_orders_that_wait_on_each_other():
    """Rank 0 runs F0 B0 F1 B1, rank 1 F1 B1 F0 B0: rank 0's B0 waits for rank 1's, which comes after
    rank 1's F1, which waits for rank 0's F1, after B0. Each order is valid alone."""
    validate, add_send_recv = torch_private("_validate_schedule", "_add_send_recv")
    compute = {0: as_torch("1f1b", 2, 0, [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]),
               1: as_torch("1f1b", 2, 1, [("F", 1, 0), ("B", 1, 0), ("F", 0, 0), ("B", 0, 0)])}
    validate(compute, 2, 2, 2)
    with pytest.raises(AssertionError, match="Malformed compute schedule"):
        add_send_recv(compute, lambda s: s, 2)


def test_torch_rejects_a_missing_message(capsys):
    """Our gpipe (p=3, m=2) with rank 1's send of microbatch 1's activation taken out: rank 2 waits."""
    simulate, = torch_private("_simulate_comms_compute")
    actions, dropped = played("gpipe", 3, 2, 1), ("send", 2, ("act", 1, 2))
    actions[1] = [("comm", [part for part in a[1] if part != dropped]) if a[0] == "comm" else a for a in actions[1]]
    assert sum(len(a[1]) for a in actions[1] if a[0] == "comm") == \
        sum(len(a[1]) for a in played("gpipe", 3, 2, 1)[1] if a[0] == "comm") - 1
    simulate(messages_as_torch("gpipe", 3, played("gpipe", 3, 2, 1)), lambda s: s, 3)
    with pytest.raises(ValueError, match="Schedule is not progressing"):
        simulate(messages_as_torch("gpipe", 3, actions), lambda s: s, 3)
    assert "2RECV_F1" in capsys.readouterr().out       # torch prints where each rank stopped


def test_a_torch_without_the_private_api_skips_naming_what_is_missing():
    with pytest.raises(pytest.skip.Exception, match="lacks torch.distributed.pipelining.schedules._no_such"):
        torch_private("_validate_schedule", "_no_such")


def test_zbv_is_torchs_own_zbv_order():
    """Our zbv order, rank by rank, against torch's ScheduleZBVZeroBubble's own (its
    _calculate_single_rank_operations, which reads only the sizes; its None padding left out)."""
    try:
        from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    except ImportError as e:
        pytest.skip(f"torch {torch.__version__} has no ScheduleZBVZeroBubble ({e})")
    from types import SimpleNamespace
    plan = getattr(ScheduleZBVZeroBubble, "_calculate_single_rank_operations", None)
    if plan is None:
        pytest.skip(f"torch {torch.__version__}'s ScheduleZBVZeroBubble plans otherwise (private API)")
    for p in range(2, 9):
        for m in range(1, 17):
            sizes = SimpleNamespace(pp_group_size=p, _n_microbatches=m, n_microbatches=m, num_stages=2 * p,
                                    _num_stages=2 * p)
            for r in range(p):
                theirs = [str(a) for a in plan(sizes, r) if a is not None]
                ours = [str(a) for a in as_torch("zbv", p, r, compute_units_flat("zbv", p, m, r))]
                assert ours == theirs, f"p={p} m={m} rank {r}:\n ours   {ours}\n theirs {theirs}"


def compute_units_flat(schedule, p, m, rank):
    return [a for unit in compute_units(schedule, p, m, rank) for a in unit]
