"""The runner: order, exactly-once across restarts, failure policy, deadlines, readiness."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest

from agent.events import Event
from agent.handlers.base import FAILED, OK, SKIPPED, Handler, HandlerSpec, Result
from agent.metrics import Metrics
from agent.runner import Runner, result_key
from agent.state import Store
from agent.tracker import Tracked, Transition

CALLS: list[tuple[str, str, str]] = []


class Recorder(Handler):
    """Records each call; `behaviour` per handler name decides what it returns."""

    type_name = "recorder"
    behaviour: dict[str, object] = {}

    def _do(self, ctx):
        CALLS.append((self.spec.name, ctx.phase, ctx.event.event_id))
        what = self.behaviour.get(self.spec.name, OK)
        if isinstance(what, Exception):
            raise what
        if what == "hang":
            threading.Event().wait(30)
        if what == "budget":
            return Result(OK, f"{ctx.timeout:.0f}")
        return Result(what)

    scheduled = started = completed = _do


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()
    Recorder.behaviour = {}


def spec(name, phases=("scheduled",), **kw):
    return HandlerSpec(name=name, type="recorder", phases=tuple(phases), **kw)


def make(tmp_path, clock, *specs, dry_run=False):
    store = Store(tmp_path, clock)
    services = SimpleNamespace(clock=clock, store=store, metrics=Metrics(), vm_name="vm1", profile=None)
    runner = Runner([Recorder(s, services) for s in specs], services, dry_run=dry_run)
    return runner, store, services


def ev(eid="E1", status="Scheduled", etype="Reboot", minutes=15, clock=None):
    nb = clock.now() + timedelta(minutes=minutes) if clock and status == "Scheduled" else None
    return Event(event_id=eid, event_type=etype, status=status, resources=("vm1",), not_before=nb)


def appeared(event, names_self=True, at=None):
    return Transition("appeared", event, names_self, at)


def test_handlers_of_a_phase_run_in_order_once(tmp_path, clock):
    """Handlers run in list order; the same transition again runs nothing."""
    runner, store, _ = make(tmp_path, clock, spec("a"), spec("b"), spec("c", phases=("completed",)))
    e = ev(clock=clock)
    runner.submit(appeared(e, at=clock.now()))
    runner.submit(appeared(e, at=clock.now()))
    assert runner.wait_idle(5)
    assert CALLS == [("a", "scheduled", "E1"), ("b", "scheduled", "E1")]
    assert store.result("E1", result_key("a", "scheduled"))["outcome"] == OK


def test_recorded_results_are_not_rerun_after_restart(tmp_path, clock):
    """A new runner over the same state runs nothing already recorded (exactly once across restarts)."""
    runner, store, _ = make(tmp_path, clock, spec("a"), spec("b"))
    e = ev(clock=clock)
    runner.submit(appeared(e))
    runner.wait_idle(5)
    CALLS.clear()
    runner2, _, _ = make(tmp_path, clock, spec("a"), spec("b"))
    runner2.store.load()
    runner2.resume({"E1": Tracked(e, True, clock.now(), "b", False)})
    runner2.wait_idle(5)
    assert CALLS == []


def test_a_run_interrupted_by_a_crash_is_not_rerun(tmp_path, clock):
    """A `running` record found at start (kill -9 mid-hook) becomes failed/interrupted, never run again."""
    runner, store, _ = make(tmp_path, clock, spec("a"))
    store.record("E1", result_key("a", "scheduled"), {"outcome": "running"})
    e = ev(clock=clock)
    t = Tracked(e, True, clock.now(), "b", False)
    runner.resume({"E1": t})
    runner.wait_idle(5)
    assert CALLS == []
    rec = store.result("E1", result_key("a", "scheduled"))
    assert rec["outcome"] == FAILED and "interrupted" in rec["detail"]
    assert not runner.is_ready(t)


def test_a_raising_handler_is_a_failed_result_and_block_keeps_the_vm_not_ready(tmp_path, clock):
    """An exception is a failed result; with on_failure: block the VM is not ready; the next handler still runs."""
    Recorder.behaviour = {"a": RuntimeError("boom")}
    runner, store, _ = make(tmp_path, clock, spec("a"), spec("b"))
    e = ev(clock=clock)
    runner.submit(appeared(e))
    runner.wait_idle(5)
    rec = store.result("E1", result_key("a", "scheduled"))
    assert rec["outcome"] == FAILED and "boom" in rec["detail"]
    assert [c[0] for c in CALLS] == ["a", "b"]
    assert runner.pending(Tracked(e, True, clock.now(), "b", False)) == ["a"]


def test_on_failure_continue_counts_as_ready(tmp_path, clock):
    """A failed handler with on_failure: continue does not hold the VM back."""
    Recorder.behaviour = {"a": FAILED}
    runner, _, _ = make(tmp_path, clock, spec("a", on_failure="continue"))
    e = ev(clock=clock)
    runner.submit(appeared(e))
    runner.wait_idle(5)
    assert runner.is_ready(Tracked(e, True, clock.now(), "b", False))


def test_filters_select_by_type_source_and_scope(tmp_path, clock):
    """event_types, event_sources and scope decide which handlers run."""
    runner, _, _ = make(tmp_path, clock, spec("reboots", event_types=("Reboot",)),
                        spec("users", event_sources=("User",)), spec("any", scope="any"))
    runner.submit(appeared(ev("E1", clock=clock), names_self=False))
    runner.submit(appeared(ev("E2", etype="Freeze", clock=clock)))
    runner.wait_idle(5)
    assert sorted(CALLS) == [("any", "scheduled", "E1"), ("any", "scheduled", "E2")]


def test_event_first_seen_started_runs_only_started_handlers(tmp_path, clock):
    """A hardware-failure Reboot born Started runs started handlers, not scheduled ones."""
    runner, _, _ = make(tmp_path, clock, spec("prep"), spec("late", phases=("started",)))
    runner.submit(appeared(ev(status="Started")))
    runner.wait_idle(5)
    assert CALLS == [("late", "started", "E1")]


def test_budget_is_capped_by_not_before_and_too_late_is_skipped(tmp_path, clock):
    """A 120 s timeout with 60 s left runs with 55 s; with 3 s left the handler is skipped: deadline."""
    Recorder.behaviour = {"a": "budget"}
    runner, store, services = make(tmp_path, clock, spec("a", timeout=120.0))
    runner.submit(appeared(Event("E1", "Preempt", "Scheduled", ("vm1",), not_before=clock.now() + timedelta(seconds=60))))
    runner.submit(appeared(Event("E2", "Preempt", "Scheduled", ("vm1",), not_before=clock.now() + timedelta(seconds=3))))
    runner.wait_idle(5)
    assert store.result("E1", result_key("a", "scheduled"))["detail"] == "55"
    rec = store.result("E2", result_key("a", "scheduled"))
    assert rec["outcome"] == SKIPPED and "deadline" in rec["detail"]
    assert services.metrics.deadline_short._value.get() == 2


def test_dry_run_runs_only_opted_in_handlers(tmp_path, clock):
    """In dry-run mode only handlers with dry_run: true run, and readiness does not wait for the rest."""
    runner, _, _ = make(tmp_path, clock, spec("a"), spec("b", dry_run=True), dry_run=True)
    e = ev(clock=clock)
    runner.submit(appeared(e))
    runner.wait_idle(5)
    assert CALLS == [("b", "scheduled", "E1")]
    assert runner.is_ready(Tracked(e, True, clock.now(), "b", False))


def test_vanished_event_runs_completed_handlers_with_the_outcome(tmp_path, clock):
    """A canceled event still runs completed handlers (undo the preparation)."""
    runner, store, _ = make(tmp_path, clock, spec("undo", phases=("completed",)))
    runner.submit(Transition("vanished", ev(clock=clock), True, clock.now(), "Scheduled", "canceled"))
    runner.wait_idle(5)
    assert CALLS == [("undo", "completed", "E1")]


def test_handler_runs_are_counted_in_metrics(tmp_path, clock):
    """maintd_handler_runs_total{handler,phase,outcome} counts every run."""
    Recorder.behaviour = {"b": FAILED}
    runner, _, services = make(tmp_path, clock, spec("a"), spec("b"))
    runner.submit(appeared(ev(clock=clock)))
    runner.wait_idle(5)
    text = services.metrics.render().decode()
    assert 'maintd_handler_runs_total{handler="a",outcome="ok",phase="scheduled"} 1.0' in text
    assert 'maintd_handler_runs_total{handler="b",outcome="failed",phase="scheduled"} 1.0' in text
