"""`/app-health` for automatic instance repairs: a drain, for maintenance or by hand, never makes the VM Unhealthy;
an Error about anything but maintenance does; the reports about maintenance itself never do."""

from __future__ import annotations

from agent.health.health_store import HealthState, HealthStore
from agent.health.rotation import Rotation
from agent.state.state_store import Store


def rotation(tmp_path, clock) -> tuple[Rotation, HealthStore]:
    health = HealthStore(clock)
    return Rotation(Store(tmp_path, clock), health, ["*"]), health


def test_drained_for_maintenance_is_out_of_rotation_and_still_healthy(tmp_path, clock):
    rot, health = rotation(tmp_path, clock)
    rot.drain("event:E1", "Reboot E1", clock.now())
    health.set("maintenance", "pending", HealthState.OK, "Reboot Scheduled")
    health.set("maintd", "maintenance/E1", HealthState.ERROR, "Reboot E1 started")
    assert not rot.verdict().in_rotation
    healthy, reason = rot.app_health()
    assert healthy and "drained" in reason


def test_an_error_other_than_maintenance_is_unhealthy_and_healthy_again_once_it_clears(tmp_path, clock):
    rot, health = rotation(tmp_path, clock)
    rot.drain("event:E1", "Reboot E1", clock.now())
    health.set("rules", "disk-full", HealthState.ERROR, "disk 99% full")
    healthy, reason = rot.app_health()
    assert not healthy and "disk 99% full" in reason
    health.set("rules", "disk-full", HealthState.OK, "disk 40% full")
    assert rot.app_health()[0]


def test_a_warning_is_healthy_unless_warnings_count_as_errors(tmp_path, clock):
    rot, health = rotation(tmp_path, clock)
    health.set("handlers", "checkpoint", HealthState.WARNING, "checkpoint failed")
    assert rot.app_health()[0]
    rot.configure(["*"], consider_warning_as_error=True)
    assert not rot.app_health()[0]


def test_an_imds_outage_leaves_app_health_healthy_while_an_application_error_does_not(tmp_path, clock):
    """IMDS silent past `stale_after` (imds/poll Error, as `/v1/health` shows it): GET /app-health still answers
    Healthy, since reimaging the VM would not bring the platform's endpoint back (and a fleet-wide outage would
    repair every VM at once); an Error of the application's own, during the same outage, is Unhealthy."""
    from agent.config.config import loads
    from agent.loop.daemon import Daemon
    from agent.systemd import Notifier
    from tests.e2e.harness import http
    from tests.imds_server import FakeImds
    from tests.loop.test_daemon import SE, run_for

    imds = FakeImds()
    imds.get(SE, body=ConnectionError("no route to host"))
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\n"
                f"imds: {{endpoint: '{imds.url}', max_backoff: 10s, stale_after: 60s}}\n"
                "server: {listen: '127.0.0.1:0', unix_socket: null}\n")
    d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
    try:
        d.serve()
        d.start()
        run_for(d, clock, 120)
        assert http().get(d.server.url + "/v1/health", timeout=5).json()["AggregatedHealthState"] == "Error"
        answer = http().get(d.server.url + "/app-health", timeout=5)
        assert answer.status_code == 200 and answer.json()["ApplicationHealthState"] == "Healthy", answer.text
        d.health.set("rules", "disk-full", HealthState.ERROR, "disk 99% full")
        answer = http().get(d.server.url + "/app-health", timeout=5)
        assert answer.json()["ApplicationHealthState"] == "Unhealthy" and "disk 99% full" in answer.json()["reason"]
        assert "poll" not in answer.json()["reason"], "the IMDS outage is not given as a reason to repair"
    finally:
        d.shutdown()
        imds.close()
