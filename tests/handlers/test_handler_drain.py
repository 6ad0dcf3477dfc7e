"""The `drain` handler and the rotation it drives: the LB wait, its end when the event goes, a full
state disk that must not undo a drain, and metrics that never disagree with the probe."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from agent.config.config import loads
from agent.handlers.base import CANCELED, OK, Context, HandlerSpec, Services, Settings
from agent.handlers.drain import DrainHandler
from agent.health.health_store import HealthState, HealthStore
from agent.health.rotation import Rotation
from agent.loop.daemon import Daemon
from agent.model.events import Event
from agent.state.state_store import Store
from agent.systemd import Notifier
from agent.telemetry.metrics import Metrics
from tests.e2e.harness import http


def parts(state_dir, clock):
    store = Store(state_dir, clock)
    health = HealthStore(clock)
    return Services(clock=clock, store=store, metrics=Metrics(), rotation=Rotation(store, health, ["*"]),
                    health=health, settings=Settings(vm_name="vm1", lb_timeout=31, drain_grace=10))


def full_disk(tmp_path):
    """A state dir that cannot be created: every write fails as on a full or read-only disk."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "state"


def run(services, clock, cancel=None, timeout=120.0):
    handler = DrainHandler(HandlerSpec(name="drain", type="drain", phases=("scheduled", "completed")), services)
    e = Event("E1", "Reboot", "Scheduled", ("vm1",), not_before=clock.now() + timedelta(minutes=10))
    ctx = Context(event=e, phase="scheduled", vm_name="vm1", names_self=True, timeout=timeout, deadline=e.not_before,
                  dry_run=False, clock=clock, cancel=cancel or threading.Event(), settings=services.settings)
    return handler.run(ctx)


def test_the_drain_waits_out_the_lb_time_from_its_settings(tmp_path, clock):
    """Out of rotation, then lb_timeout + drain_grace (41 s) on the clock."""
    services = parts(tmp_path, clock)
    t0 = clock.monotonic()
    result = run(services, clock)
    assert result.outcome == OK and clock.monotonic() - t0 == pytest.approx(41)
    assert not services.rotation.verdict().in_rotation


def test_on_a_full_disk_the_drain_takes_effect_and_waits_its_time(tmp_path, clock):
    """The state cannot be saved: the VM still leaves rotation, the LB wait still runs, the run is ok."""
    services = parts(full_disk(tmp_path), clock)
    t0 = clock.monotonic()
    result = run(services, clock)
    assert result.outcome == OK, result
    assert clock.monotonic() - t0 == pytest.approx(41)
    assert not services.rotation.verdict().in_rotation
    assert not services.rotation.saved and services.store.write_error


def test_a_drain_for_an_event_already_gone_is_lifted_again(tmp_path, clock):
    """If completed ran first (the event left while the drain was starting), no drain is left behind."""
    services = parts(tmp_path, clock)
    gone = threading.Event()
    gone.set()
    result = run(services, clock, cancel=gone)
    assert result.outcome == CANCELED
    assert services.rotation.verdict().in_rotation


@pytest.fixture
def daemon(tmp_path, clock):
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {full_disk(tmp_path)}}}\n"
                "server: {listen: '127.0.0.1:0', require_token_on_loopback: false, unix_socket: null}\n")
    d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
    d.serve()
    yield d
    d.shutdown()


def test_post_drain_on_a_full_disk_answers_with_a_note_not_an_error(daemon):
    """`maintd drain` works from memory when the disk is full: 200, a note that the state is not saved yet."""
    answer = http().post(daemon.server.url + "/v1/drain", json={"reason": "disk test"}, timeout=5)
    assert answer.status_code == 200, answer.text
    assert answer.json()["drained"] is True and "not yet saved" in answer.json()["note"]
    assert http().get(daemon.server.url + "/probe", timeout=5).status_code == 503


def test_rotation_metrics_agree_with_the_probe_at_every_scrape(daemon):
    """No tick between the change and the scrape: the gauges follow the drain and the health at once."""
    def scrape():
        text = daemon.metrics.render().decode()
        return {k: float(v) for k, v in (line.split() for line in text.splitlines()
                                          if line.startswith(("maintd_in_rotation ", "maintd_health_state ")))}
    assert scrape() == {"maintd_in_rotation": 1.0, "maintd_health_state": 0.0}
    daemon.rotation.drain("manual", "test", daemon.clock.now())
    assert scrape()["maintd_in_rotation"] == 0.0
    daemon.rotation.undrain("manual")
    daemon.health.set("watchdog", "db", HealthState.ERROR, "down")
    assert scrape() == {"maintd_in_rotation": 0.0, "maintd_health_state": 2.0}
