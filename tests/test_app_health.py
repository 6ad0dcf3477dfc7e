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
