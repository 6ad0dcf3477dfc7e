"""The `alertmanager` handler against a real Alertmanager (Debian's prometheus-alertmanager on 127.0.0.1):
an alert for the VM fires during maintenance and is silenced, and is not once the event is over; a restart
mid-event leaves exactly one silence; a replica that is down does not keep the other from its silence; a
silence someone deleted is made again while maintenance lasts."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from agent.clock import SystemClock
from agent.config.config import loads
from agent.handlers.base import CANCELED, FAILED, OK, Context, Services, Settings
from agent.handlers.registry import instantiate
from agent.health.health_store import HealthStore
from agent.health.rotation import Rotation
from agent.model.events import Event
from agent.model.tracker import Tracked, Transition
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.alertmanager import alertmanagers, needs_alertmanager  # noqa: F401 (fixture)
from tests.e2e.harness import free_port, wait_until

pytestmark = needs_alertmanager
EVENT_ID = "5DD55F9A-0000-4000-8000-0000000000AB"
INSTANCE = "vm000001:9100"


def services(tmp_path) -> Services:
    clock = SystemClock()
    store = Store(tmp_path / "state", clock)
    health = HealthStore(clock)
    return Services(clock=clock, store=store, metrics=Metrics(), rotation=Rotation(store, health, ["*"]),
                    health=health, settings=Settings(vm_name="vm-1", computer_name="vm000001"))


def handler(svc: Services, urls: list[str], extra: str = "", timeout: str = "3s"):
    cfg = loads("handlers:\n  - {name: silence, type: alertmanager, phases: [scheduled, started, completed], "
                f"urls: [{', '.join(urls)}], matchers: ['instance=~\"{{computer_name}}(:[0-9]+)?\"'], "
                f"margin: 2m, recheck: 1s, timeout: {timeout}{extra}}}\n")
    return instantiate(cfg.handlers, svc)[0]


def event(status: str = "Scheduled", minutes: float = 10) -> Event:
    nb = datetime.now(UTC) + timedelta(minutes=minutes) if status == "Scheduled" else None
    return Event(event_id=EVENT_ID, event_type="Reboot", status=status, resources=("vm-1",), not_before=nb,
                 duration_seconds=-1)


def present(svc: Services, e: Event) -> None:
    """The event as the loop stores it while it is in the document."""
    svc.store.apply({e.event_id: Tracked(e, True, datetime.now(UTC), "", False)}, [])


def gone(svc: Services, e: Event, outcome: str = "completed") -> None:
    """The event left the document."""
    svc.store.apply({}, [Transition("vanished", e, True, datetime.now(UTC), outcome=outcome)])


def run(h, svc: Services, e: Event, phase: str, outcome: str | None = None):
    ctx = Context(event=e, phase=phase, vm_name="vm-1", names_self=True, timeout=h.spec.timeout,
                  deadline=e.not_before, dry_run=False, clock=svc.clock, cancel=threading.Event(),
                  settings=svc.settings, outcome=outcome)
    return h.run(ctx)


def test_the_vms_alert_is_silenced_while_it_is_out_of_rotation_and_not_after_the_event(tmp_path, alertmanagers):
    (am,) = alertmanagers(1)
    am.fire(instance=INSTANCE)
    am.fire(instance="vm000002:9100")
    svc = services(tmp_path)
    h = handler(svc, [am.url])
    e = event()
    present(svc, e)
    assert run(h, svc, e, "scheduled").outcome == OK
    assert [s["status"]["state"] for s in am.live()] == ["pending"], "pending until the VM leaves rotation"
    assert am.silenced_by(instance=INSTANCE) == []

    svc.rotation.drain(f"event:{EVENT_ID}", "Reboot", datetime.now(UTC))
    h.keep()
    (silence,) = am.live()
    assert silence["status"]["state"] == "active"
    assert silence["createdBy"] == "maintd@vm-1" and EVENT_ID in silence["comment"]
    assert am.silenced_by(instance=INSTANCE) == [silence["id"]]
    assert am.silenced_by(instance="vm000002:9100") == [], "another VM's alert is not silenced"
    note = svc.store.result(EVENT_ID, "note:silence")
    assert note["silences"][am.url]["id"] == silence["id"] and silence["id"] in note["summary"]

    gone(svc, e)  # the VM is still drained
    assert run(h, svc, e, "completed", outcome="completed").outcome == OK
    assert am.silenced_by(instance=INSTANCE) == [silence["id"]], "kept until the VM is back in rotation"
    svc.rotation.undrain(f"event:{EVENT_ID}")
    assert h.keep() is None
    assert am.live() == [] and am.silenced_by(instance=INSTANCE) == []


def test_a_restart_mid_event_leaves_exactly_one_silence_even_with_the_note_lost(tmp_path, alertmanagers):
    (am,) = alertmanagers(1)
    am.fire(instance=INSTANCE)
    svc = services(tmp_path)
    e = event("Started")
    present(svc, e)
    assert run(handler(svc, [am.url]), svc, e, "started").outcome == OK
    (first,) = am.live()

    again = services(tmp_path)  # maintd restarted: a new store loaded from the same directory
    again.store.load()
    h = handler(again, [am.url])
    h.keep()
    assert run(h, again, e, "started").outcome == OK  # an interrupted run goes again
    assert [s["id"] for s in am.live()] == [first["id"]]

    lost = services(tmp_path / "fresh")  # the state file was lost: maintd finds its own silence by its comment
    present(lost, e)
    assert run(handler(lost, [am.url]), lost, e, "started").outcome == OK
    assert [s["id"] for s in am.live()] == [first["id"]]
    assert am.silenced_by(instance=INSTANCE) == [first["id"]]


def test_a_replica_that_is_down_does_not_keep_the_other_from_its_silence(tmp_path, alertmanagers):
    (am,) = alertmanagers(1)
    am.fire(instance=INSTANCE)
    down = f"http://127.0.0.1:{free_port()}"
    svc = services(tmp_path)
    h = handler(svc, [down, am.url])
    e = event("Started")
    present(svc, e)
    result = run(h, svc, e, "started")
    assert result.outcome == FAILED and "127.0.0.1" in result.detail
    assert h.spec.on_failure == "continue", "a silence never holds preparation by default"
    (silence,) = am.live()
    assert am.silenced_by(instance=INSTANCE) == [silence["id"]]
    (report,) = [r for r in svc.health.to_json()["HealthEvents"] if r["Property"] == "silence/silences"]
    assert report["HealthState"] == "Warning"
    assert svc.metrics.silence_failures.labels("silence")._value.get() >= 1


def test_a_deleted_silence_is_made_again_while_maintenance_lasts_and_a_cancel_expires_at_once(tmp_path,
                                                                                                alertmanagers):
    replicas = alertmanagers(2)
    for am in replicas:
        am.fire(instance=INSTANCE)
    svc = services(tmp_path)
    h = handler(svc, [am.url for am in replicas])
    e = event("Started")
    present(svc, e)
    assert run(h, svc, e, "started").outcome == OK
    first = [am.live()[0]["id"] for am in replicas]
    replicas[1].delete(first[1])
    assert replicas[1].silenced_by(instance=INSTANCE) == []

    def remade() -> bool:
        h.keep()
        return bool(replicas[1].silenced_by(instance=INSTANCE))

    wait_until(remade, 10, "the deleted silence to be made again", interval=0.2)
    assert [len(am.live()) for am in replicas] == [1, 1]
    assert replicas[0].live()[0]["id"] == first[0]

    gone(svc, e, CANCELED)
    assert run(h, svc, e, "completed", outcome=CANCELED).outcome == OK
    assert [am.live() for am in replicas] == [[], []]


@pytest.mark.parametrize("status", ["Scheduled"])
def test_the_silence_ends_margin_after_the_expected_end(tmp_path, alertmanagers, status):
    (am,) = alertmanagers(1)
    svc = services(tmp_path)
    e = event(status, minutes=10)
    present(svc, e)
    assert run(handler(svc, [am.url]), svc, e, "scheduled").outcome == OK
    (silence,) = am.live()
    assert e.not_before is not None
    ends = datetime.fromisoformat(silence["endsAt"].replace("Z", "+00:00"))
    expected = e.not_before + timedelta(seconds=900 + 120)  # Reboot's default impact + margin
    assert abs((ends - expected).total_seconds()) < 1


def test_told_the_vm_leaves_rotation_next_the_silence_is_active_at_once(tmp_path, alertmanagers):
    """The runner runs the silence right before the drain and says so: the silence is active before the probe
    fails (not pending until the keeper sees the drain)."""
    (am,) = alertmanagers(1)
    am.fire(instance=INSTANCE)
    svc = services(tmp_path)
    h = handler(svc, [am.url])
    e = event()
    present(svc, e)
    ctx = Context(event=e, phase="scheduled", vm_name="vm-1", names_self=True, timeout=h.spec.timeout,
                  deadline=e.not_before, dry_run=False, clock=svc.clock, cancel=threading.Event(),
                  settings=svc.settings, leaving_rotation=True)
    assert h.run(ctx).outcome == OK
    (silence,) = am.live()
    assert silence["status"]["state"] == "active" and am.silenced_by(instance=INSTANCE) == [silence["id"]]


def test_the_keeper_does_not_wait_behind_a_run_that_retries(tmp_path, alertmanagers):
    """A phase's run retrying a refusing Alertmanager (in the background, say) holds the event's silence; the
    keeper, shared by every kept silence, looks again a second later instead of waiting for it."""
    (am,) = alertmanagers(1)
    am.stop()
    svc = services(tmp_path)
    h = handler(svc, [am.url], timeout="20s")
    e = event()
    present(svc, e)
    ctx = Context(event=e, phase="scheduled", vm_name="vm-1", names_self=True, timeout=20.0, deadline=e.not_before,
                  dry_run=False, clock=svc.clock, cancel=threading.Event(), settings=svc.settings)
    runner = threading.Thread(target=h.run, args=(ctx,), daemon=True)
    runner.start()
    wait_until(lambda: (svc.store.result(EVENT_ID, "note:silence") or {}).get("state") == "keeping", 10,
               "the note of the run's first round")
    assert h.keep() == pytest.approx(1.0) and runner.is_alive(), "keep returned while the run still retries"
    ctx.cancel.set()
    runner.join(10)
