"""The schedules are data: checked against literal tables and played for deadlocks, no processes."""
import pytest

import pipeline_microbatch as pm
from mp.pp import schedules
from mp.tools import schedule as schedule_tool
from pipeline_microbatch import PipelineRank, partition
from mp.pp.p2p import receives_ahead
from mp.pp.schedules import compute_order, dry_run, eval_actions, schedule_actions


def table(schedule, p, m, v=1):
    return [" ".join(f"{kind}{mb}" + (f".{chunk}" if v > 1 else "") for kind, mb, chunk in
                     compute_order(schedule, p, m, rank, v)) for rank in range(p)]


def test_gpipe_runs_all_forwards_then_all_backwards():
    assert table("gpipe", 3, 3) == ["F0 F1 F2 B0 B1 B2"] * 3


def test_1f1b_has_warm_up_steady_state_and_cool_down():
    assert table("1f1b", 4, 4) == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_1f1b_with_fewer_microbatches_than_stages():
    assert table("1f1b", 4, 2) == ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]


def test_interleaved_goes_p_microbatches_through_each_chunk():
    assert table("interleaved", 2, 2, v=2) == [
        "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0",   # warm-up 2(p-1) + (v-1)p = 4: all forwards
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0",   # warm-up 2, then 1F1B on chunk 1 (the last stage)
    ]


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 3, 1, 1),
                                            ("interleaved", 4, 8, 2), ("interleaved", 3, 6, 3)])
def test_every_microbatch_runs_forward_then_backward_once_per_chunk(schedule, p, m, v):
    for rank in range(p):
        order = compute_order(schedule, p, m, rank, v)
        assert sorted(a for a in order if a[0] == "F") == [("F", i, c) for i in range(m) for c in range(v)]
        assert all(order.index(("F", i, c)) < order.index(("B", i, c)) for i in range(m) for c in range(v))


def in_flight(order):
    """The most microbatches whose activations a rank holds at once: from F until the backward
    that frees them (B, or W where the backward is split)."""
    held, peak, freed_by = 0, 0, "W" if any(kind == "W" for kind, _, _ in order) else "B"
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1 if kind == freed_by else 0
        peak = max(peak, held)
    return peak


def test_1f1b_holds_at_most_p_minus_rank_microbatches_gpipe_holds_all():
    p, m = 4, 32
    assert [in_flight(compute_order("1f1b", p, m, r)) for r in range(p)] == [4, 3, 2, 1]
    assert [in_flight(compute_order("gpipe", p, m, r)) for r in range(p)] == [m] * p


def every_rank(schedule, p, m, v=1, fused=True):
    placement = schedules.placement_of(schedule)
    return [schedule_actions(schedule, PipelineRank(r, p, list(range(p)), v, placement=placement), m, fused)
            for r in range(p)]


def test_every_send_has_its_receive():
    actions = every_rank("interleaved", 4, 8, 2)
    sends = {(r, peer, msg) for r, acts in enumerate(actions) for a in acts if a[0] == "comm"
             for kind, peer, msg in a[1] if kind == "send"}
    recvs = {(peer, r, msg) for r, acts in enumerate(actions) for a in acts if a[0] == "comm"
             for kind, peer, msg in a[1] if kind == "recv"}
    assert sends == recvs and len(sends) == 2 * (4 * 2 - 1) * 8


CASES = [(s, p, m, 1) for s in ("gpipe", "1f1b", "zb") for p in (2, 3, 4, 5) for m in (1, 2, 3, 4, 7, 16)] + \
        [("interleaved", p, k * p, v) for p in (2, 3, 4) for k in (1, 2, 3) for v in (1, 2, 3)] + \
        [("zbv", p, m, 2) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 9, 16)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_real_schedules_never_deadlock_even_with_blocking_sends(schedule, p, m, v):
    assert dry_run(every_rank(schedule, p, m, v)) is None


def test_the_textbook_order_deadlocks_and_the_dry_run_names_the_cycle():
    """Send, then receive, one message at a time: stage 0 sends microbatch 1 forward while
    stage 1 sends microbatch 0's gradient back; both sends wait for a receive that never comes."""
    cycle = dry_run(every_rank("1f1b", 2, 2, fused=False))
    assert cycle == ["rank 0 blocked in send act of microbatch 1 with rank 1",
                     "rank 1 blocked in send grad of microbatch 0 with rank 0"]
    for p, m in [(3, 4), (4, 8)]:
        assert dry_run(every_rank("1f1b", p, m, fused=False)) is not None
    assert dry_run(every_rank("interleaved", 4, 8, 2, fused=False)) is not None


def test_partition_is_even_or_as_balanced():
    assert partition(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert partition(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert partition(5, 4, "2,1,1,1") == [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_clock_tables_draw_the_bubble_of_the_formula():
    assert schedules.clock_table("1f1b", 4, 4) == [
        "stage 0: F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3",
        "stage 1: .  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
        "stage 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        "stage 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    for schedule, p, m, v in [("gpipe", 4, 4, 1), ("1f1b", 4, 4, 1), ("1f1b", 3, 8, 1), ("1f1b", 4, 2, 1),
                              ("interleaved", 4, 4, 2), ("interleaved", 2, 6, 3)]:
        rows = [row.split(": ")[1].split() for row in schedules.clock_table(schedule, p, m, v)]
        ticks = max(len(row) for row in rows)
        assert ticks == 2 * (v * m + p - 1), (schedule, p, m, v)
        idle = 1 - sum(len(row) - row.count(".") for row in rows) / (p * ticks)
        assert idle == pytest.approx(schedules.bubble_theory(p, m, v))


def test_the_module_docstring_shows_the_tables_the_code_runs():
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]:
        table = "\n".join("    " + row for row in schedules.clock_table(schedule, 4, 4, v))
        assert table in schedules.__doc__, schedule
    assert "\n".join("    " + row for row in schedules.clock_table("zbv", 2, 3, 2)) in schedules.__doc__


def test_a_forward_never_waits_for_a_gradient_in_gpipe_and_1f1b():
    """The exchange before F receives only its activation (it used to wait for the next B's gradient too)."""
    for schedule in ("gpipe", "1f1b"):
        for actions in every_rank(schedule, 4, 8):
            for before, action in zip(actions, actions[1:]):
                if action[0] == "F" and before[0] == "comm":
                    assert all(msg[0] == "act" for kind, _, msg in before[1] if kind == "recv"), (schedule, before)


def test_the_issue_example_deadlocks_one_message_at_a_time():
    """Counted from 1: stage 2 sends microbatch 2 forward while stage 3 sends microbatch 1's gradient back."""
    assert dry_run(every_rank("1f1b", 3, 4, fused=False)) == [
        "rank 1 blocked in send act of microbatch 1 with rank 2",
        "rank 2 blocked in send grad of microbatch 0 with rank 1"]
    assert dry_run(every_rank("1f1b", 3, 4)) is None


def test_1f1b_exchanges_are_megatrons_fused_pairs():
    """Stage 1 of 4, 4 microbatches: each action is preceded by one exchange named after its data flow."""
    actions = schedule_actions("1f1b", PipelineRank(1, 4, [0, 1, 2, 3]), 4)
    assert [pm.flow_name(a[1]) if a[0] == "comm" else f"{a[0]}{a[1]}" for a in actions] == [
        "recv_forward", "F0", "send_forward_recv_forward", "F1", "send_forward_recv_forward", "F2",
        "send_forward_recv_backward", "B0", "send_backward_recv_forward", "F3", "send_forward_recv_backward", "B1",
        "send_backward_recv_backward", "B2", "send_backward_recv_backward", "B3", "send_backward"]


def test_the_forward_only_evaluation_order_never_deadlocks():
    for p, n, v in [(2, 4, 2), (3, 5, 2), (4, 20, 3), (4, 4, 1), (3, 1, 2)]:
        assert dry_run([eval_actions(PipelineRank(r, p, list(range(p)), v), n) for r in range(p)]) is None
    chunk_by_chunk = [schedules.with_communication([[("F", mb, c)] for c in range(2) for mb in range(4)],
                                            PipelineRank(r, 2, [0, 1], 2)) for r in range(2)]
    assert dry_run(chunk_by_chunk) == ["rank 0 blocked in send act of microbatch 2 with rank 1",
                                       "rank 1 blocked in send act of microbatch 0 with rank 0"]


def test_the_dry_run_names_a_receive_that_no_rank_sends():
    assert dry_run([[("comm", [("recv", 1, ("act", 0, 0))])], [("F", 0, 0)]]) == [
        "rank 0 blocked in recv act of microbatch 0 with rank 1, which has finished"]


# ----------------------------------------------------------------------------- zero bubble (ZB-H1)


def test_zb_is_1f1b_with_w_split_off_and_run_rank_microbatches_late():
    assert table("zb", 4, 4) == [
        "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3",
        "F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3",
        "F0 F1 B0 F2 B1 F3 B2 W0 B3 W1 W2 W3",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3",
    ]
    assert table("zb", 2, 3) == ["F0 F1 B0 W0 F2 B1 W1 B2 W2", "F0 B0 F1 B1 W0 F2 B2 W1 W2"]


def test_zb_with_fewer_microbatches_than_stages():
    assert table("zb", 3, 2) == ["F0 F1 B0 W0 B1 W1", "F0 F1 B0 B1 W0 W1", "F0 B0 F1 B1 W0 W1"]
    assert table("zb", 2, 1) == ["F0 B0 W0", "F0 B0 W0"]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 4), (4, 9), (5, 16)])
def test_zb_runs_every_pass_once_w_after_its_b_and_keeps_1f1bs_bound(p, m):
    for rank in range(p):
        order = compute_order("zb", p, m, rank)
        for kind in "FBW":
            assert sorted(a for a in order if a[0] == kind) == [(kind, i, 0) for i in range(m)]
        assert all(order.index(("F", i, 0)) < order.index(("B", i, 0)) < order.index(("W", i, 0)) for i in range(m))
        assert [a for a in order if a[0] != "W"] == compute_order("1f1b", p, m, rank)   # 1F1B, W aside
        assert in_flight(order) <= max(in_flight(compute_order("1f1b", p, m, r)) for r in range(p)) == min(p, m)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 3), (4, 4), (4, 8), (5, 12)])
def test_zb_clock_table_has_the_zero_bubble_formula(p, m):
    rows = [row.split(": ")[1].split() for row in schedules.clock_table("zb", p, m)]
    ticks = max(len(row) for row in rows)
    assert ticks == 3 * m + p - 1
    idle = 1 - 3 * m * p / (p * ticks)
    assert idle == pytest.approx(schedules.bubble_theory(p, m, schedule="zb"))
    assert idle < schedules.bubble_theory(p, m) / 2          # 1F1B's, in the same ticks


def test_zb_sends_the_input_gradient_before_the_weight_gradient_runs():
    """B's gradient goes upstream in the exchange right after B; W has no messages of its own."""
    for rank, actions in enumerate(every_rank("zb", 3, 4)):
        for i, action in enumerate(actions):
            if action[0] == "B" and rank > 0:
                after = actions[i + 1]
                assert after[0] == "comm" and ("send", rank - 1, ("grad", action[1], rank - 1)) in after[1]
            if action[0] == "W":
                assert schedules.messages(action, PipelineRank(rank, 3, [0, 1, 2])) == (None, None)


def test_the_command_line_prints_and_draws_the_planned_table(tmp_path, capsys):
    out = tmp_path / "zb.png"
    schedule_tool.main(["--schedule", "zb", "--stages", "4", "--microbatches", "4", "-o", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "zb: 4 stages, 4 microbatches; 15 ticks, idle 20.0% of the table = bubble_theory 20.0%"
    assert lines[1:5] == schedules.clock_table("zb", 4, 4) and lines[5] == f"wrote {out}"
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
    schedule_tool.main(["--schedule", "interleaved", "--stages", "2", "--microbatches", "4", "--virtual-stages", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("interleaved: 2 stages, 4 microbatches, v=3 chunks per rank") and "7.7%" in lines[0]
    assert lines[1:] == schedules.clock_table("interleaved", 2, 4, 3)


@pytest.mark.parametrize("argv,message", [
    (["--stages", "0"], "error: --stages 0 must be a positive integer"),
    (["--schedule", "interleaved", "--microbatches", "6"],
     "error: --schedule interleaved needs --microbatches a multiple of --stages 4, got 6; use --microbatches 8 or 4"),
    (["--virtual-stages", "2"], "error: --virtual-stages 2 applies only to --schedule interleaved, not 1f1b"),
    (["--schedule", "2bw", "--microbatches", "2"], "error: --schedule 2bw needs --microbatches at least --stages 4"),
    (["--schedule", "zbv", "--virtual-stages", "3"], "error: --schedule zbv places exactly 2 chunks on each rank"),
])
def test_the_command_line_refuses_bad_sizes_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        schedule_tool.main(argv)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(message), err


# ----------------------------------------------------------------------------- zero bubble in a V (ZB-V)


def test_the_v_places_chunk_1_of_rank_r_at_2p_minus_1_minus_r():
    p = 4
    assert [schedules.virtual_stage(c, r, p, "v") for c in (0, 1) for r in range(p)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [schedules.virtual_stage(c, r, p) for c in (0, 1) for r in range(p)] == list(range(8))   # the loop
    for placement in ("v", "loop"):
        assert all(schedules.stage_owner(schedules.virtual_stage(c, r, p, placement), p, placement) == (r, c)
                   for c in (0, 1) for r in range(p))
    ranks = [PipelineRank(r, p, [10, 11, 12, 13], 2, placement="v") for r in range(p)]
    assert [pos.is_last_stage for pos in ranks] == [True, False, False, False]   # rank 0 holds the loss
    assert ranks[3].peer(0, +1) == (13, 1) and ranks[0].peer(1, -1) == (11, 1) and ranks[1].peer(1, +1) == (10, 1)


def test_zbv_follows_torchs_order_warm_up_steady_state_and_cool_down():
    """p=2, m=3 (torch's ScheduleZBVZeroBubble's order, its padding left out): rank 0 runs 2(p-r)-1 = 3
    forwards of chunk 0, then F B W of chunk 1; rank 1 alternates chunks from the start (the V's tip)."""
    assert table("zbv", 2, 3, v=2) == [
        "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0.0 W0.0 F2.1 B2.1 W2.1 B1.0 W1.0 B2.0 W2.0",
        "F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1 W1.1 B1.0 B2.1 B2.0 W1.0 W2.1 W2.0",
    ]


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 7), (4, 16), (8, 9)])
def test_zbv_runs_every_pass_once_w_after_b_and_holds_what_1f1bs_first_stage_holds(p, m):
    for rank in range(p):
        order = compute_order("zbv", p, m, rank)
        for kind in "FBW":
            assert sorted(a for a in order if a[0] == kind) == [(kind, i, c) for i in range(m) for c in (0, 1)]
        assert all(order.index(("F", i, c)) < order.index(("B", i, c)) < order.index(("W", i, c))
                   for i in range(m) for c in (0, 1))
        assert in_flight(order) <= 2 * min(p, m)   # chunks of half a stage: 1F1B's first stage's p microbatches


def test_zbv_messages_skip_the_tip_of_the_v():
    """Rank p-1's chunk 0 feeds its own chunk 1 (virtual stages p-1 and p): no message either way."""
    p = 3
    pos = PipelineRank(p - 1, p, list(range(p)), 2, placement="v")
    assert schedules.messages(("F", 0, 0), pos) == (("recv", 1, ("act", 0, 2)), None)
    assert schedules.messages(("F", 0, 1), pos) == (None, ("send", 1, ("act", 0, 4)))
    assert schedules.messages(("B", 0, 1), pos) == (("recv", 1, ("grad", 0, 3)), None)
    assert schedules.messages(("B", 0, 0), pos) == (None, ("send", 1, ("grad", 0, 1)))
    top = PipelineRank(0, p, list(range(p)), 2, placement="v")      # the model's two ends: no message out
    assert schedules.messages(("F", 0, 1), top)[1] is None and schedules.messages(("B", 0, 1), top)[0] is None
    every = every_rank("zbv", p, 5, 2)
    assert not any(peer == r for r, acts in enumerate(every) for a in acts if a[0] == "comm" for _, peer, _ in a[1])


def test_zbv_with_1f1bs_message_rule_deadlocks_and_the_clock_tables_placement_does_not():
    """Sends posted right after their compute (with_communication, as 1f1b) block zbv's ranks on each
    other: chunk 0's forwards go down while chunk 1's come up. Placed on the clock table, they do not."""
    positions = [PipelineRank(r, 2, [0, 1], 2, placement="v") for r in range(2)]
    naive = [schedules.with_communication([[a] for a in schedules.zbv_order(2, 4, r)], pos)
             for r, pos in enumerate(positions)]
    assert dry_run(naive) is not None
    assert dry_run(every_rank("zbv", 2, 4, 2)) is None


def test_a_plan_for_placed_chunks_refuses_the_other_placement():
    with pytest.raises(AssertionError, match="zbv runs on chunks placed 'v'"):
        schedule_actions("zbv", PipelineRank(0, 2, [0, 1], 2), 4)


@pytest.mark.parametrize("p,m", [(2, 3), (2, 8), (3, 5), (4, 7), (4, 8), (4, 16), (8, 15)])
def test_zbv_clock_table_has_its_formula_half_of_zbs_bubble(p, m):
    rows = [row.split(": ")[1].split() for row in schedules.clock_table("zbv", p, m, 2)]
    ticks = max(len(row) for row in rows)
    assert ticks == 6 * m + p - 1
    idle = 1 - 6 * m * p / (p * ticks)
    assert idle == pytest.approx(schedules.bubble_theory(p, m, 2, "zbv")) == pytest.approx((p - 1) / (6 * m + p - 1))
    assert idle < schedules.bubble_theory(p, m, schedule="zb") < schedules.bubble_theory(p, m, schedule="1f1b")


def test_zbv_bubble_with_fewer_microbatches_than_fill_the_v_is_the_tables():
    for p, m in [(2, 2), (4, 4), (8, 3)]:
        rows = schedules.clock_cells("zbv", p, m, 2)
        assert schedules.bubble_theory(p, m, 2, "zbv") == pytest.approx(1 - 6 * m / max(map(len, rows)))


def test_the_command_line_draws_zbv(capsys):
    schedule_tool.main(["--schedule", "zbv", "--stages", "4", "--microbatches", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("zbv: 4 stages, 8 microbatches, v=2 chunks per rank") and "51 ticks" in lines[0]
    assert "idle 5.9% of the table = bubble_theory 5.9%" in lines[0]
    assert lines[1:] == schedules.clock_table("zbv", 4, 8, 2)


def played_span(all_actions):
    """Ticks to play every rank's actions when each F, B and W lasts one tick, a send is posted when its
    rank reaches it and never waits, and a receive waits for its send: what the messages' placement adds."""
    clock, at, sent = [0] * len(all_actions), [0] * len(all_actions), {}
    while any(a < len(actions) for a, actions in zip(at, all_actions)):
        before = list(at)
        for r, actions in enumerate(all_actions):
            while at[r] < len(actions):
                action = actions[at[r]]
                if action[0] != "comm":
                    clock[r], at[r] = clock[r] + 1, at[r] + 1
                    continue
                sent.update({msg: clock[r] for kind, _, msg in action[1] if kind == "send"})
                recvs = [msg for kind, _, msg in action[1] if kind == "recv"]
                if not all(msg in sent for msg in recvs):
                    break
                clock[r], at[r] = max([clock[r]] + [sent[msg] for msg in recvs]), at[r] + 1
        assert at != before, "stuck"
    return max(clock)


@pytest.mark.parametrize("p,m", [(2, 3), (2, 8), (3, 5), (4, 8), (4, 16), (8, 16)])
def test_zbv_messages_cost_the_clock_table_no_tick(p, m):
    """Each message is posted at the tick its reader starts on the clock table, so the plan played with
    one-tick actions spans the table's 6m+p-1 ticks, as zb's spans its 3m+p-1: the messages add no wait."""
    assert played_span(every_rank("zbv", p, m, 2)) == 6 * m + p - 1
    assert played_span(every_rank("zb", p, m)) == 3 * m + p - 1


def test_receives_ahead_are_the_next_k_exchanges_receives_in_their_order():
    """What gloo posts early at each exchange (mp.pp.p2p): the receives of the k exchanges
    after it, in the order the schedule posts them, so that untagged matching (nccl's) would pair
    them alike; 0 exchanges: nothing."""
    for schedule, v in (("1f1b", 1), ("zbv", 2), ("interleaved", 2)):
        for r, actions in enumerate(every_rank(schedule, 2, 8, v)):
            exchanges = [i for i, a in enumerate(actions) if a[0] == "comm"]
            receives = [[part for part in actions[i][1] if part[0] == "recv"] for i in exchanges]
            ahead = receives_ahead(actions, 3)
            assert list(ahead) == exchanges
            for n, i in enumerate(exchanges):
                assert ahead[i] == [part for later in receives[n + 1:n + 4] for part in later], (schedule, r, n)
            assert all(parts == [] for parts in receives_ahead(actions, 0).values())


def test_zbv_with_its_sends_at_once_finishes_only_when_sends_never_block():
    """zbv's plan on gloo (schedule_actions(..., sends_at_once=True), mp.pp.p2p): every send in the exchange
    right after its compute. With sends that never block (that executor waits for them at the step's
    end) every rank finishes, p 2-8, m 1-16; with sends that block (nccl's stream) the same plan
    deadlocks from m = 2 on, which is why nccl keeps rendezvous's placement. Every other plan finishes
    both ways."""
    for p in range(2, 9):
        for m in range(1, 17):
            at_once = [schedule_actions("zbv", PipelineRank(r, p, list(range(p)), 2, placement="v"), m,
                                        sends_at_once=True) for r in range(p)]
            assert dry_run(at_once, blocking_sends=False) is None, (p, m)
            assert (dry_run(at_once) is None) == (m == 1), (p, m)
            placed = every_rank("zbv", p, m, 2)
            assert dry_run(placed) is None and dry_run(placed, blocking_sends=False) is None, (p, m)
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        assert dry_run(every_rank(schedule, 4, 8, v), blocking_sends=False) is None, schedule


def test_the_dry_run_without_blocking_sends_still_names_a_missing_send():
    """blocking_sends=False can fail too: a receive whose send no rank posts is named."""
    actions = every_rank("zbv", 2, 2, 2)
    gone = ("send", 1, ("act", 0, 1))
    actions[0] = [(a[0], [part for part in a[1] if part != gone]) if a[0] == "comm" else a for a in actions[0]]
    actions[0] = [a for a in actions[0] if a[0] != "comm" or a[1]]
    assert any("with rank 0" in line for line in dry_run(actions, blocking_sends=False))
