"""Fleet history, the pure parts: one VM's outcome built from what its state store kept, the record's blob and its
parsing back, the summary line of an event (the most out at once from the intervals, the longest out, who was not
prepared before the start), and when a write is due (at most two per VM per event)."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from agent.coordination.store.store_protocol import Item
from agent.fleet.fleet_history import EXISTED, FAILED, RECORDED, SENDING, due
from agent.fleet.history_protocol import (
    VmOutcome,
    days,
    group_name,
    history_blob,
    history_view,
    most_out_at_once,
    parse_record,
    summary,
    to_metadata,
    with_approval,
)
from agent.loop.event_end import outcome_for
from agent.model.timefmt import iso_z

T0 = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def vm(name: str, out: float | None, back: float | None, ready: float | None = 10.0, started: float | None = 100.0,
       chosen: str | None = None) -> VmOutcome:
    return VmOutcome(event_id="e1", event_type="Reboot", vm=name, not_before=at(300), out_at=None if out is None
                     else at(out), back_at=None if back is None else at(back), ready_at=None if ready is None
                     else at(ready), started_at=None if started is None else at(started), approved_by=None,
                     approved_at=None, handlers=(("drain", "scheduled", "ok"),), chosen=chosen, ended_at=at(400),
                     day=date(2026, 11, 27))


def test_most_out_at_once_counts_overlapping_intervals_and_not_one_that_ends_as_the_next_begins():
    assert most_out_at_once([]) == 0
    assert most_out_at_once([(at(0), at(10)), (at(10), at(20)), (at(20), at(30))]) == 1
    assert most_out_at_once([(at(0), at(30)), (at(5), at(10)), (at(8), at(40)), (at(35), at(50))]) == 3


def test_the_summary_line_has_the_vms_the_most_out_at_once_the_longest_out_and_who_was_late():
    records = [vm("web_1", 0, 60), vm("web_2", 50, 200, chosen="forced"), vm("web_3", None, None),
               vm("web_4", 210, 250, ready=150.0)]
    s = summary(records)
    assert s == {"vms": 4, "most_out_at_once": 2, "longest_out_seconds": 150.0, "longest_out_vm": "web_2",
                 "not_prepared_before_start": ["web_4"], "forced": ["web_2"]}


def test_a_vm_that_never_came_back_is_out_until_its_record_ended():
    assert vm("web_1", 100, None).out_seconds == 300.0


def test_prepared_before_start_uses_the_start_seen_else_the_approval_else_not_before():
    assert vm("a", 0, 1, ready=90, started=100).prepared_before_start is True
    assert vm("a", 0, 1, ready=110, started=100).prepared_before_start is False
    assert vm("a", 0, 1, ready=None, started=100).prepared_before_start is False
    assert vm("a", 0, 1, ready=290, started=None).prepared_before_start is True  # NotBefore at 300


def test_a_record_survives_the_store_and_comes_back_the_same():
    record = vm("web_3f2a9c1b", 5, 95)
    name = history_blob("web", record)
    assert name == "history/web/2026-11-27/e1/web_3f2a9c1b"
    metadata = to_metadata(record)
    assert all(isinstance(v, str) and v.isascii() for v in metadata.values())
    assert parse_record(Item(name, metadata, '"0x1"', at(500))) == record
    blank = vm("a", None, None, ready=None, started=None)
    no_blanks = {k: v for k, v in to_metadata(blank).items() if v}
    assert parse_record(Item(name, no_blanks, None, None)) == blank
    assert parse_record(Item(name, {k: v or None for k, v in to_metadata(blank).items()}, None, None)) == blank


def test_anything_the_protocol_did_not_write_is_no_record_and_never_an_exception():
    good = to_metadata(vm("a", 0, 1))
    name = "history/web/2026-11-27/e1/a"
    for bad in ({}, {**good, "maintd": "2"}, {**good, "ended_at": ""}, {**good, "out_at": "yesterday"},
                {**good, "chosen": "maybe"}, {**good, "handlers": "nonsense"}, {**good, "vm": None},
                {**good, "type": 3},
                {k: v for k, v in good.items() if k != "ended_at"}, {**good, "out_at": "2026-11-27T01:00:00"}):
        assert parse_record(Item(name, bad, None, None)) is None
    assert parse_record(Item("history/web/not-a-day/e1/a", good, None, None)) is None
    assert parse_record(Item("history/web/e1", good, None, None)) is None


def test_the_view_lists_each_vm_once_and_leaves_out_events_that_ended_before_since():
    twice = [vm("b", 0, 10), vm("a", 5, 20), vm("A", 5, 20)]
    old = VmOutcome(**{**vm("c", 0, 1).__dict__, "event_id": "e0", "ended_at": at(-86400 * 8)})
    events = history_view([*twice, old], since=at(-86400 * 7))
    assert [e["event_id"] for e in events] == ["e1"]
    assert [v["vm"] for v in events[0]["vms"]] == ["a", "b"]
    assert events[0]["summary"]["most_out_at_once"] == 2
    assert events[0]["vms"][0]["out_seconds"] == 15.0 and events[0]["vms"][0]["prepared_before_start"] is True


def test_who_approved_comes_from_the_store_when_this_vm_did_not_approve():
    record = vm("a", 0, 1)
    found = with_approval(record, {"state": "approved", "by": "web_2"}, at(120))
    assert (found.approved_by, found.approved_at) == ("web_2", at(120))
    assert with_approval(record, {"state": "claimed", "by": "web_2"}, at(120)) == record
    mine = VmOutcome(**{**record.__dict__, "approved_by": "a", "approved_at": at(90)})
    assert with_approval(mine, {"state": "approved", "by": "web_2"}, at(120)) == mine


def test_the_group_is_the_budget_s_else_the_scale_set_else_one_for_all_and_always_one_path_segment():
    assert group_name("Web", "vmss") == "web"
    assert group_name(None, "My/Scale Set") == "my-scale-set"
    assert group_name(None, None) == group_name(None, "") == "_"


def test_a_week_is_eight_day_folders_and_never_more_than_a_month():
    assert len(days(at(0) - timedelta(days=7), at(0))) == 8
    assert len(days(at(0) - timedelta(days=400), at(0))) == 31
    assert days(at(0), at(0)) == [date(2026, 11, 27)]


def test_a_write_is_due_once_and_retried_at_most_once():
    now = at(1000)
    assert due(None, now, None) == 1
    assert due(None, now, 1) is None  # queued, not started yet
    assert due({"status": SENDING, "attempt": 1}, now, 1) is None  # under way
    assert due({"status": RECORDED, "attempt": 1}, now, 1) is None
    assert due({"status": EXISTED, "attempt": 2}, now, None) is None
    assert due({"status": SENDING, "attempt": 1}, now, None) == 2  # found after a restart: once more
    assert due({"status": SENDING, "attempt": 2}, now, None) is None
    assert due({"status": FAILED, "attempt": 1, "at": iso_z(at(990))}, now, 1) is None  # too soon
    assert due({"status": FAILED, "attempt": 1, "at": iso_z(at(900))}, now, 1) == 2
    assert due({"status": FAILED, "attempt": 2, "at": iso_z(at(0))}, now, 2) is None
    assert due({"status": "nonsense"}, now, None) is None


def test_the_outcome_comes_from_the_state_store_s_records():
    record = {"event": {"EventId": "E1", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["web_1"],
                        "NotBefore": "Fri, 27 Nov 2026 01:05:00 GMT"},
              "names_self": True, "first_seen": iso_z(at(0)), "vanished_at": iso_z(at(200)),
              "history": [{"kind": "appeared", "at": iso_z(at(0)), "status": "Scheduled"},
                          {"kind": "status_changed", "at": iso_z(at(150)), "status": "Started"},
                          {"kind": "vanished", "at": iso_z(at(200)), "status": "Started"}]}
    results = {"handler:drain:scheduled": {"outcome": "ok", "started_at": iso_z(at(1)), "finished_at": iso_z(at(43))},
               "handler:hook:scheduled": {"outcome": "ok", "started_at": iso_z(at(1)), "finished_at": iso_z(at(60))},
               "handler:drain:completed": {"outcome": "ok", "started_at": iso_z(at(201)),
                                           "finished_at": iso_z(at(202))},
               "rotation": {"out_at": iso_z(at(1)), "back_at": iso_z(at(201))},
               "approval": {"status": "sent", "by": "web_1", "at": iso_z(at(61))},
               "note:silence": {"summary": "x"}}
    out = outcome_for("web_1", record, results, prepared=True, chosen=None)
    assert (out.out_at, out.back_at, out.ready_at, out.started_at) == (at(1), at(201), at(60), at(150))
    assert (out.approved_by, out.approved_at, out.ended_at, out.day) == ("web_1", at(61), at(202), date(2026, 11, 27))
    assert out.prepared_before_start is True and out.out_seconds == 200.0
    assert out.handlers == (("drain", "completed", "ok"), ("drain", "scheduled", "ok"), ("hook", "scheduled", "ok"))
    started = {**record, "event": {**record["event"], "EventStatus": "Started", "NotBefore": ""},
               "not_before": "2026-11-28T00:05:00Z"}  # IMDS sends no NotBefore once Started: the one kept counts
    assert outcome_for("web_1", started, results, prepared=True, chosen=None).day == date(2026, 11, 28)
    late = outcome_for("web_1", record, {**results, "approval": {"status": "failed"}}, prepared=False, chosen="forced")
    assert late.ready_at is None and late.prepared_before_start is False and late.approved_by is None
    assert late.chosen == "forced"


class Lane:
    """The history lane as the loop sees it: what it was handed (the real one writes to the store)."""

    def __init__(self) -> None:
        self.handed: list[tuple[str, VmOutcome, int]] = []

    def write(self, group: str, outcome: VmOutcome, attempt: int) -> None:
        self.handed.append((group, outcome, attempt))


def test_the_loop_hands_an_event_over_once_and_only_after_its_completed_runs_finished(tmp_path, clock):
    from agent.loop.event_end import CHECK_EVERY, EventEnds
    from agent.model.tracker import Tracked, Transition
    from agent.prepare.readiness import Readiness
    from tests.prepare.test_runner import ev, make, spec

    runner, store, _ = make(tmp_path, clock, spec("prep"), spec("undo", phases=("completed",)))
    lane = Lane()
    ends = EventEnds(store, Readiness.of(runner), lane, clock, lambda: "web")  # type: ignore[arg-type]
    e = ev(clock=clock)
    appeared = Transition("appeared", e, True, clock.now())
    store.apply({"E1": Tracked(e, True, clock.now(), "b", False)}, [appeared])
    runner.submit(appeared)
    assert runner.wait_idle(5)
    clock.advance(60)
    gone = Transition("vanished", e, True, clock.now(), outcome="completed")
    store.apply({}, [gone])
    ends.tick("vm1")
    assert lane.handed == []  # gone, but its `completed` run has not run yet: not ended for this VM
    runner.submit(gone)
    assert runner.wait_idle(5)
    for _ in range(3):
        clock.advance(CHECK_EVERY)
        ends.tick("vm1")
    assert [(g, o.event_id, o.vm, n) for g, o, n in lane.handed] == [("web", "E1", "vm1", 1)]
    assert lane.handed[0][1].ready_at is not None and lane.handed[0][1].prepared_before_start is True
    store.record("E1", "history", {"status": SENDING, "attempt": 1, "at": iso_z(clock.now())})
    restarted = EventEnds(store, Readiness.of(runner), lane, clock, lambda: "web")  # type: ignore[arg-type]
    restarted.tick("vm1")  # killed mid-request: once more, and never a third time
    clock.advance(CHECK_EVERY)
    restarted.tick("vm1")
    assert [n for _, _, n in lane.handed] == [1, 2]
