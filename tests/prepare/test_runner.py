"""The runner: order, exactly-once across restarts, failure policy, deadlines, readiness."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from agent.handlers.base import FAILED, OK, SKIPPED, Handler, HandlerSpec, Result, Services, Settings
from agent.health.health_store import HealthStore
from agent.health.rotation import Rotation
from agent.model.events import Event
from agent.model.tracker import Tracked, Transition
from agent.prepare.handler_runner import Runner
from agent.prepare.readiness import Readiness
from agent.prepare.run_records import RunKey
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.samples import sample

CALLS: list[tuple[str, str, str]] = []
ATTEMPTS: list[int] = []
STARTED = threading.Event()
RELEASE = threading.Event()


class Recorder(Handler):
    """Records each call; `behaviour` per handler name decides what it returns."""

    type_name = "recorder"
    behaviour: dict[str, object] = {}

    def _do(self, ctx):
        CALLS.append((self.spec.name, ctx.phase, ctx.event.event_id))
        ATTEMPTS.append(ctx.attempt)
        what = self.behaviour.get(self.spec.name, OK)
        if isinstance(what, Exception):
            raise what
        if what == "hang":
            threading.Event().wait(30)
        if what == "until_cut":  # a long wait that honours the cancel flag, like a drain's LB wait
            STARTED.set()
            ctx.cancel.wait(30)
            return Result(FAILED, "cut short")
        if what == "stubborn":  # ignores the cancel flag, like a hook with cancel_grace: wait
            STARTED.set()
            RELEASE.wait(30)
            return Result(OK)
        if what == "budget":
            return Result(OK, f"{ctx.timeout:.0f}")
        return Result(what)

    scheduled = started = completed = _do


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()
    ATTEMPTS.clear()
    STARTED.clear()
    RELEASE.clear()
    Recorder.behaviour = {}
    yield
    RELEASE.set()


def spec(name, phases=("scheduled",), **kw):
    return HandlerSpec(name=name, type="recorder", phases=tuple(phases), **kw)


def make(tmp_path, clock, *specs, dry_run=False):
    store = Store(tmp_path, clock)
    health = HealthStore(clock)
    services = Services(clock=clock, store=store, metrics=Metrics(), rotation=Rotation(store, health, ["*"]),
                        health=health, settings=Settings(vm_name="vm1"))
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
    assert store.result("E1", str(RunKey("a", "scheduled")))["outcome"] == OK


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


def interrupted(tmp_path, clock, attempt, **kw):
    """A runner restarted over a `running` record of handler a (kill -9 during attempt `attempt`)."""
    runner, store, services = make(tmp_path, clock, spec("a", **kw))
    store.record("E1", str(RunKey("a", "scheduled")), {"outcome": "running", "attempt": attempt})
    t = Tracked(ev(clock=clock), True, clock.now(), "b", False)
    runner.resume({"E1": t})
    assert runner.wait_idle(5)
    return runner, store, t


def test_a_run_interrupted_by_a_crash_runs_again_with_the_next_attempt(tmp_path, clock):
    """A `running` record found at start (kill -9 mid-hook) runs again with attempt 2; the VM becomes ready."""
    runner, store, t = interrupted(tmp_path, clock, 1)
    assert CALLS == [("a", "scheduled", "E1")] and ATTEMPTS == [2]
    assert store.result("E1", str(RunKey("a", "scheduled")))["outcome"] == OK
    assert Readiness.of(runner).is_ready(t)


def test_interrupted_runs_stop_after_max_attempts_and_say_what_to_do(tmp_path, clock):
    """The third interrupted attempt (of 3) is failed, not run again, and the reason names the way out."""
    runner, store, t = interrupted(tmp_path, clock, 3)
    assert CALLS == []
    assert store.result("E1", str(RunKey("a", "scheduled")))["outcome"] == FAILED
    assert Readiness.of(runner).not_ready(t) == ["a failed (interrupted, attempt 3 of 3); on_failure: block — "
                                   "approve by hand with `maintd approve E1`"]


def test_rerun_interrupted_false_keeps_at_most_once(tmp_path, clock):
    """rerun_interrupted: false records an interrupted run failed and never runs it again."""
    runner, store, t = interrupted(tmp_path, clock, 1, rerun_interrupted=False)
    assert CALLS == []
    assert "rerun_interrupted: false" in Readiness.of(runner).not_ready(t)[0]


def test_an_interrupted_completed_run_of_a_gone_event_runs_again(tmp_path, clock):
    """kill -9 during the undrain of an event that has left the document: the restart runs it again."""
    runner, store, _ = make(tmp_path, clock, spec("undo", phases=("completed",)))
    e = ev(clock=clock)
    store.apply({}, [Transition("vanished", e, True, clock.now(), "Scheduled", "completed")])
    store.record("E1", str(RunKey("undo", "completed")), {"outcome": "running", "attempt": 1})
    runner.resume({})
    assert runner.wait_idle(5)
    assert CALLS == [("undo", "completed", "E1")] and ATTEMPTS == [2]


def test_an_interrupted_scheduled_run_is_not_rerun_once_the_event_has_started(tmp_path, clock):
    """The event turned Started while maintd was down: its interrupted scheduled run is failed, not rerun."""
    runner, store, _ = make(tmp_path, clock, spec("a"))
    store.record("E1", str(RunKey("a", "scheduled")), {"outcome": "running", "attempt": 1})
    runner.resume({"E1": Tracked(ev(status="Started"), True, clock.now(), "b", True)})
    assert runner.wait_idle(5)
    assert CALLS == []
    rec = store.result("E1", str(RunKey("a", "scheduled")))
    assert rec["outcome"] == FAILED and "moved on" in rec["detail"]


def test_a_vanishing_event_cuts_its_work_and_runs_completed_at_once(tmp_path, clock, logs):
    """The run under way is cut (recorded canceled), the next is skipped, completed handlers run; the log says so."""
    Recorder.behaviour = {"wait": "until_cut"}
    runner, store, _ = make(tmp_path, clock, spec("wait"), spec("later"), spec("undo", phases=("completed",)))
    e = ev(clock=clock)
    runner.submit(appeared(e))
    assert STARTED.wait(5)
    runner.submit(Transition("vanished", e, True, clock.now(), "Scheduled", "canceled"))
    assert runner.wait_idle(5)
    assert CALLS == [("wait", "scheduled", "E1"), ("undo", "completed", "E1")]
    assert store.result("E1", str(RunKey("wait", "scheduled")))["outcome"] == "canceled"
    later = store.result("E1", str(RunKey("later", "scheduled")))
    assert later["outcome"] == SKIPPED and "left the document" in later["detail"]
    cut = [e for e in logs if e["event"] == "handler.canceling"]
    assert [(e["event_id"], e["handler"], e["reason"]) for e in cut] == [("E1", "wait", "event canceled")]


def test_completed_does_not_wait_behind_a_run_that_ignores_the_cut(tmp_path, clock):
    """A handler that keeps running after its event is gone does not hold back the completed phase."""
    Recorder.behaviour = {"slow": "stubborn"}
    runner, store, _ = make(tmp_path, clock, spec("slow"), spec("undo", phases=("completed",)))
    e = ev(clock=clock)
    runner.submit(appeared(e))
    assert STARTED.wait(5)
    runner.submit(Transition("vanished", e, True, clock.now(), "Scheduled", "completed"))
    deadline = threading.Event()
    for _ in range(100):
        if ("undo", "completed", "E1") in CALLS:
            break
        deadline.wait(0.05)
    assert ("undo", "completed", "E1") in CALLS, "completed ran while the scheduled run was still under way"
    RELEASE.set()
    assert runner.wait_idle(5)


def test_not_ready_reasons_say_what_holds_the_vm(tmp_path, clock):
    """Before a run, and after a failure under on_failure: block, the reason names the handler and the way out."""
    Recorder.behaviour = {"b": FAILED}
    runner, _, _ = make(tmp_path, clock, spec("a"), spec("b"))
    t = Tracked(ev(clock=clock), True, clock.now(), "b", False)
    assert Readiness.of(runner).not_ready(t) == ["a has not run yet", "b has not run yet"]
    runner.submit(appeared(t.event))
    runner.wait_idle(5)
    assert Readiness.of(runner).not_ready(t) == [
        "b failed; on_failure: block — approve by hand with `maintd approve E1`"]


def test_the_profile_snapshot_narrows_the_handlers(tmp_path, clock):
    """Handlers outside the settings snapshot's list (the profile in force) do not run."""
    runner, _, services = make(tmp_path, clock, spec("a"), spec("b"))
    services.settings = Settings(vm_name="vm1", handlers=("b",))
    runner.submit(appeared(ev(clock=clock)))
    runner.wait_idle(5)
    assert CALLS == [("b", "scheduled", "E1")]


def test_a_raising_handler_is_a_failed_result_and_block_keeps_the_vm_not_ready(tmp_path, clock):
    """An exception is a failed result; with on_failure: block the VM is not ready; the next handler still runs."""
    Recorder.behaviour = {"a": RuntimeError("boom")}
    runner, store, _ = make(tmp_path, clock, spec("a"), spec("b"))
    e = ev(clock=clock)
    runner.submit(appeared(e))
    runner.wait_idle(5)
    rec = store.result("E1", str(RunKey("a", "scheduled")))
    assert rec["outcome"] == FAILED and "boom" in rec["detail"]
    assert [c[0] for c in CALLS] == ["a", "b"]
    assert Readiness.of(runner).pending(Tracked(e, True, clock.now(), "b", False)) == ["a"]


def test_on_failure_continue_counts_as_ready(tmp_path, clock):
    """A failed handler with on_failure: continue does not hold the VM back."""
    Recorder.behaviour = {"a": FAILED}
    runner, _, _ = make(tmp_path, clock, spec("a", on_failure="continue"))
    e = ev(clock=clock)
    runner.submit(appeared(e))
    runner.wait_idle(5)
    assert Readiness.of(runner).is_ready(Tracked(e, True, clock.now(), "b", False))


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
    runner.submit(appeared(Event("E1", "Preempt", "Scheduled", ("vm1",),
                                 not_before=clock.now() + timedelta(seconds=60))))
    runner.submit(appeared(Event("E2", "Preempt", "Scheduled", ("vm1",),
                                 not_before=clock.now() + timedelta(seconds=3))))
    runner.wait_idle(5)
    assert store.result("E1", str(RunKey("a", "scheduled")))["detail"] == "55"
    rec = store.result("E2", str(RunKey("a", "scheduled")))
    assert rec["outcome"] == SKIPPED and "deadline" in rec["detail"]
    assert sample(services.metrics, "maintd_deadline_short_total") == 2


class UntilNotBefore(Recorder):
    """A handler whose run may last until NotBefore by design (a hold): it needs only its floor."""

    def wanted_timeout(self, settings, configured):
        return 30.0


def test_a_handler_that_may_hold_until_not_before_is_short_only_below_what_it_needs(tmp_path, clock):
    """A 1 h timeout cut to the 15 min before NotBefore is no shortfall for a hold that needs 30 s (no
    `deadline.short`); with 20 s left it is one."""
    Recorder.behaviour = {"a": "budget"}
    store = Store(tmp_path, clock)
    health = HealthStore(clock)
    services = Services(clock=clock, store=store, metrics=Metrics(), rotation=Rotation(store, health, ["*"]),
                        health=health, settings=Settings(vm_name="vm1"))
    runner = Runner([UntilNotBefore(spec("a", timeout=3600.0), services)], services)
    runner.submit(appeared(ev("E1", clock=clock)))
    runner.wait_idle(5)
    assert sample(services.metrics, "maintd_deadline_short_total") == 0
    soon = clock.now() + timedelta(seconds=25)
    runner.submit(appeared(Event("E2", "Reboot", "Scheduled", ("vm1",), not_before=soon)))
    runner.wait_idle(5)
    assert sample(services.metrics, "maintd_deadline_short_total") == 1


def test_dry_run_runs_only_opted_in_handlers(tmp_path, clock):
    """In dry-run mode only handlers with dry_run: true run, and readiness does not wait for the rest."""
    runner, _, _ = make(tmp_path, clock, spec("a"), spec("b", dry_run=True), dry_run=True)
    e = ev(clock=clock)
    runner.submit(appeared(e))
    runner.wait_idle(5)
    assert CALLS == [("b", "scheduled", "E1")]
    assert Readiness.of(runner).is_ready(Tracked(e, True, clock.now(), "b", False))


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
