"""Preparation at the planned time, through the daemon's loop on a fake clock with IMDS mocked:
held work, windows that move the approval, reloads, restarts and the views that show the plan."""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime, timedelta

import pytest

from agent.clock import FakeClock
from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.state.journal import read_journal
from agent.systemd import Notifier
from tests.loop.test_daemon import SE, imds  # noqa: F401 (IMDS scripted for the daemon's life; approvals succeed)

UTC = UTC
MONDAY_10 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
NIGHTLY = """
profiles:
  - name: business-hours
    approval: never
    recurrence: {frequency: week, schedule: {hours: [8], minutes: [0],
                 week_days: [monday, tuesday, wednesday, thursday, friday]}}
  - name: nightly
    approval: auto
    recurrence: {frequency: day, schedule: {hours: [22], minutes: [0]}}
  - name: default
    approval: never
"""


def at(text):
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def event(eid="E1", etype="Reboot", not_before=MONDAY_10 + timedelta(days=3), status="Scheduled"):
    return {"EventId": eid, "EventType": etype, "ResourceType": "VirtualMachine", "Resources": ["vm1"],
            "EventStatus": status, "NotBefore": email.utils.format_datetime(not_before, usegmt=True)
            if status == "Scheduled" else "", "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


@pytest.fixture
def clock():
    return FakeClock(MONDAY_10)


@pytest.fixture
def make(tmp_path, clock, imds):
    started = []

    def make(extra: str, *events, hook: str = "true"):
        imds.upsert("GET", SE, json={"DocumentIncarnation": 1, "Events": list(events)})
        text = (f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path / 'state'}}}\nimds: {{endpoint: '{imds.url}'}}\n"
                "handlers:\n  - {name: checkpoint, type: exec, phases: [scheduled], "
                f"command: [/bin/sh, -c, '{hook}']}}\n"
                + extra)
        path = tmp_path / "maintd.yaml"
        path.write_text(text)
        path.chmod(0o600)
        d = Daemon(loads(text), clock, boot_id="boot-1", notifier=Notifier({}), config_path=str(path))
        d.start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.shutdown()


def run_until(d, clock, when):
    """Tick once a second (fake) up to `when`, jumping over long quiet stretches."""
    while clock.now() < when:
        gap = (when - clock.now()).total_seconds()
        clock.advance(min(gap, 1.0) if gap <= 5 else gap - 5)
        d.cadence.next_poll = min(d.cadence.next_poll, clock.monotonic())
        d.tick()
    d.runner.wait_idle(10)
    d.coordinator.wait_idle(10)
    d.store.wait_saved(5)  # the loop's records and journal lines are written in the background
    d.tick()
    d.coordinator.wait_idle(10)


def approvals(imds):
    return [c for c in imds.calls if c.method == "POST"]


def plan_of(d, eid):
    """The `plan` object /v1/events/{id} shows."""
    return d.preparation.view(eid, d.coordinator.view(eid))


def prepare_series(d):
    """The exposed maintd_event_prepare_timestamp_seconds series (labels and value)."""
    name = "maintd_event_prepare_timestamp_seconds"
    lines = [line[len(name):].split() for line in d.metrics.render().decode().splitlines()
             if line.startswith(name + "{")]
    return [(labels, float(value)) for labels, value in lines]


def ran(d, eid="E1"):
    return d.store.result(eid, "handler:checkpoint:scheduled")


def test_a_three_day_reboot_prepares_before_the_night_window_and_is_approved_inside_it(make, clock, imds):
    d = make(NIGHTLY + "prepare:\n  lead_time_by_type: {Reboot: 30m}\n", event())
    run_until(d, clock, MONDAY_10 + timedelta(seconds=3))
    assert ran(d) is None, "held: business hours forbid approval, the night window is hours away"
    view = plan_of(d, "E1")
    assert (view["prepare_at"], view["prepare_reason"], view["preparation"]) == \
        ("2026-01-05T21:30:00Z", "window", "held")
    assert prepare_series(d) == [('{event_type="Reboot"}', at("2026-01-05T21:30:00").timestamp())]
    assert d.rotation.verdict().in_rotation, "the VM stays in rotation while it waits"

    run_until(d, clock, at("2026-01-05T21:29:50"))
    assert ran(d) is None
    run_until(d, clock, at("2026-01-05T21:30:02"))
    assert ran(d)["outcome"] == "ok" and d.readiness.is_ready(d.tracked["E1"])
    assert not approvals(imds), "ready, but business hours still forbid approval"
    assert prepare_series(d) == [], "nothing waits any more"

    run_until(d, clock, at("2026-01-05T22:00:02"))
    assert len(approvals(imds)) == 1 and d.store.result("E1", "approval")["status"] == "sent"
    sent_at = datetime.fromisoformat(d.store.result("E1", "approval")["at"])
    assert at("2026-01-05T22:00:00") <= sent_at < at("2026-01-06T08:00:00")
    kinds = [e["kind"] for e in read_journal(d.store.dir) if e.get("event_id") == "E1"]
    assert kinds.index("plan.made") < kinds.index("preparation.started") < kinds.index("approval.sent"), kinds


def test_a_preempt_prepares_at_once_whatever_the_profile(make, clock, imds):
    d = make(NIGHTLY + "prepare:\n  lead_time: 2h\n  lead_time_by_type: {Preempt: now}\n",
             event(etype="Preempt", not_before=MONDAY_10 + timedelta(seconds=30)))
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    assert ran(d)["outcome"] == "ok"
    assert plan_of(d, "E1")["prepare_reason"] == "now"
    assert not approvals(imds), "business hours: never"


def test_a_change_freeze_holds_preparation_until_notbefore_minus_lead_time(make, clock, imds):
    freeze = ("profiles:\n  - {name: freeze, approval: never, fixed_date: {start: 2026-01-01T00:00:00Z, "
              "end: 2026-01-20T00:00:00Z}}\n  - {name: default, approval: auto}\nprepare: {lead_time: 2h}\n")
    d = make(freeze, event(not_before=at("2026-01-07T12:00:00")))
    run_until(d, clock, at("2026-01-07T09:59:50"))
    assert ran(d) is None
    plan = plan_of(d, "E1")
    assert (plan["approve_reason"], plan["approve_not_before"]) == ("no_window", None)
    run_until(d, clock, at("2026-01-07T10:00:02"))
    assert ran(d)["outcome"] == "ok"
    run_until(d, clock, at("2026-01-07T11:59:00"))
    assert not approvals(imds), "the freeze forbids approval: Azure starts it at NotBefore"


def test_a_window_that_closes_before_the_vm_is_ready_sends_nothing(make, clock, imds, tmp_path):
    gate = tmp_path / "go"
    slot = ("profiles:\n  - {name: slot, approval: auto, fixed_date: {start: 2026-01-05T22:00:00Z, "
            "end: 2026-01-05T22:05:00Z}}\n  - {name: default, approval: never}\nprepare: {lead_time: 1m}\n")
    d = make(slot, event(), hook=f"while [ ! -f {gate} ]; do sleep 0.02; done")
    run_until(d, clock, at("2026-01-05T21:58:50"))
    assert d.store.result("E1", "preparation") is None
    clock.advance(20)
    d.tick()  # 21:59:10: released; the hook now waits for the test
    assert d.store.result("E1", "preparation")["reason"] == "window"
    for _ in range(7 * 60):  # the whole slot passes while the checkpoint runs
        clock.advance(1)
        d.cadence.next_poll = clock.monotonic()
        d.tick()
    gate.write_text("")
    run_until(d, clock, at("2026-01-05T22:07:00"))
    assert ran(d)["outcome"] == "ok" and d.readiness.is_ready(d.tracked["E1"])
    run_until(d, clock, at("2026-01-06T09:00:00"))
    assert not approvals(imds), "never outside the window"
    assert plan_of(d, "E1")["approve_reason"] == "no_window"


def test_a_reload_replans_held_events_but_never_rolls_back_one_preparing(make, clock, imds, tmp_path):
    d = make(NIGHTLY + "prepare:\n  lead_time: 30m\n",
             event("E1"), event("E2", etype="Redeploy"))
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    assert d.preparation.release("E2", "operator") and not d.preparation.release("E2", "operator")
    run_until(d, clock, MONDAY_10 + timedelta(seconds=4))
    assert ran(d, "E2")["outcome"] == "ok" and ran(d, "E1") is None

    path = tmp_path / "maintd.yaml"
    path.write_text(path.read_text().replace("lead_time: 30m", "lead_time: 2h"))
    d.control.request_reload()
    run_until(d, clock, MONDAY_10 + timedelta(seconds=6))
    e1, e2 = plan_of(d, "E1"), plan_of(d, "E2")
    assert e1["prepare_at"] == "2026-01-05T20:00:00Z" and e1["preparation"] == "held"
    assert e2["preparation"] == "started" and e2["prepare_reason"] == "operator"
    changes = [e for e in read_journal(d.store.dir) if e["kind"] == "plan.changed"]
    assert [(c["event_id"], c["cause"]) for c in changes] == [("E1", "reload")]


def test_a_restart_keeps_held_work_held(make, clock, imds):
    d = make(NIGHTLY + "prepare:\n  lead_time: 30m\n", event())
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    d.shutdown()
    again = make(NIGHTLY + "prepare:\n  lead_time: 30m\n", event())
    run_until(again, clock, MONDAY_10 + timedelta(seconds=4))
    assert ran(again) is None and plan_of(again, "E1")["preparation"] == "held"
    run_until(again, clock, at("2026-01-05T21:30:02"))
    assert ran(again)["outcome"] == "ok"


def test_a_held_event_that_vanishes_drops_its_work(make, clock, imds):
    d = make(NIGHTLY + "prepare:\n  lead_time: 30m\n", event())
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    imds.upsert("GET", SE, json={"DocumentIncarnation": 2, "Events": []})
    run_until(d, clock, MONDAY_10 + timedelta(seconds=4))
    run_until(d, clock, at("2026-01-05T21:31:00"))
    assert ran(d) is None and plan_of(d, "E1") is None
    assert any(e["kind"] == "preparation.dropped" for e in read_journal(d.store.dir))


def test_the_default_config_prepares_at_first_sight(make, clock, imds, tmp_path):
    """Today's behaviour; and a reload that changes nothing for the event journals no plan change."""
    d = make("profiles: [{name: default, approval: auto, rules: [{approval: never, event_types: [Freeze]}]}]\n",
             event())
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    assert ran(d)["outcome"] == "ok"
    assert plan_of(d, "E1")["prepare_reason"] == "now"
    path = tmp_path / "maintd.yaml"
    path.write_text(path.read_text() + "prepare: {lead_time: 10m}\n")
    d.control.request_reload()
    run_until(d, clock, MONDAY_10 + timedelta(seconds=10))
    assert len(approvals(imds)) == 1
    assert not [e for e in read_journal(d.store.dir) if e["kind"] == "plan.changed"]


def test_a_planning_failure_prepares_at_once_and_says_so(make, clock, imds, monkeypatch, logs):
    """Bad input never costs an event its preparation: the plan falls back to today's behaviour."""
    def broken(*args, **kwargs):
        raise ValueError("a schedule nobody foresaw")

    monkeypatch.setattr("agent.prepare.preparation.make_plan", broken)
    d = make(NIGHTLY + "prepare:\n  lead_time: 30m\n", event())
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    assert ran(d)["outcome"] == "ok"
    assert plan_of(d, "E1")["prepare_detail"].startswith("planning failed")
    assert any(e["event"] == "plan.failed" for e in logs)


def test_after_a_restart_a_started_preparation_shows_when_and_why_it_started(make, clock, imds):
    d = make(NIGHTLY + "prepare:\n  lead_time: 30m\n", event())
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    d.preparation.release("E1", "operator")
    run_until(d, clock, MONDAY_10 + timedelta(seconds=4))
    d.shutdown()
    again = make(NIGHTLY + "prepare:\n  lead_time: 30m\n", event())
    run_until(again, clock, MONDAY_10 + timedelta(seconds=6))
    plan = plan_of(again, "E1")
    assert (plan["preparation"], plan["prepare_reason"]) == ("started", "operator")
    assert plan["prepare_at"].startswith("2026-01-05T10:00:0"), "when the operator's go came, not 21:30"
    assert plan["approve_not_before"] == "2026-01-05T22:00:00Z"
    assert [e["kind"] for e in read_journal(again.store.dir)].count("preparation.started") == 1


def test_a_moved_notbefore_moves_the_preparation(make, clock, imds):
    """Azure reschedules a held event: the plan follows (journaled as event_changed) and so does the work."""
    freeze = ("profiles:\n  - {name: freeze, approval: never, fixed_date: {start: 2026-01-01T00:00:00Z, "
              "end: 2026-01-20T00:00:00Z}}\n  - {name: default, approval: auto}\nprepare: {lead_time: 2h}\n")
    d = make(freeze, event(not_before=at("2026-01-07T12:00:00")))
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    imds.upsert("GET", SE, json={"DocumentIncarnation": 2,
                                         "Events": [event(not_before=at("2026-01-06T12:00:00"))]})
    run_until(d, clock, MONDAY_10 + timedelta(seconds=4))
    assert plan_of(d, "E1")["prepare_at"] == "2026-01-06T10:00:00Z"
    assert [e["cause"] for e in read_journal(d.store.dir) if e["kind"] == "plan.changed"] == ["event_changed"]
    run_until(d, clock, at("2026-01-06T10:00:02"))
    assert ran(d)["outcome"] == "ok"


def test_after_a_restart_an_interrupted_run_goes_again_once_against_the_notbefore_imds_shows_now(
        make, clock, imds, tmp_path):
    """The hook was cut by a crash with NotBefore a minute away; during the restart Azure moved NotBefore
    15 minutes later. Measured against the old NotBefore the rerun was skipped ("too close to NotBefore");
    preparation resumes from the first successful poll instead, with the event as IMDS shows it: the
    interrupted run goes again, once."""
    runs = tmp_path / "runs"
    hook = f"echo run >> {runs}"
    d = make("", event(not_before=MONDAY_10 + timedelta(minutes=1)), hook=hook)
    run_until(d, clock, MONDAY_10 + timedelta(seconds=2))
    assert runs.read_text().count("run") == 1
    d.store.record("E1", "handler:checkpoint:scheduled",
                   {"outcome": "running", "started_at": "2026-01-05T10:00:01Z", "attempt": 1})  # killed mid-run
    d.store.wait_saved(5)
    d.shutdown()
    clock.advance(56)  # the restart takes a while: the old NotBefore is 2 s away
    again = make("", event(not_before=MONDAY_10 + timedelta(minutes=15)), hook=hook)
    run_until(again, clock, MONDAY_10 + timedelta(seconds=62))
    assert runs.read_text().count("run") == 2
    assert ran(again)["outcome"] == "ok" and ran(again)["attempt"] == 2
