"""`/app-health` for the Application Health extension and automatic instance repairs, with a real agent: Healthy
while the VM is drained for maintenance (while `/probe` says 503), Unhealthy on a health Error that is not about
maintenance, Healthy again once it clears."""

from __future__ import annotations

import time

import pytest

from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e

HANDLERS = {"handlers": [
    {"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]},
    {"name": "health", "type": "health", "phases": ["scheduled", "started", "completed"], "started_state": "Error"}],
    "probe": {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"}}


def app_health(agent) -> str:
    answer = agent.get("/app-health")
    assert answer.status_code == 200, answer.text
    return str(answer.json()["ApplicationHealthState"])


def test_app_health_stays_healthy_through_a_drain_and_says_unhealthy_only_on_a_real_error(
        start_emulator, start_agent) -> None:
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", HANDLERS)
    assert app_health(agent) == "Healthy"
    emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
    wait_until(lambda: agent.get("/probe").status_code == 503, 15, "the probe to say 503 (drained)")
    wait_until(lambda: agent.get("/v1/health").json()["AggregatedHealthState"] != "Ok", 15,
               "the health handler's maintenance report")
    samples = []
    for _ in range(10):  # drained for maintenance, a maintenance Warning reported: never a reason to repair
        samples.append((agent.get("/probe").status_code, app_health(agent)))
        time.sleep(0.1)
    assert samples == [(503, "Healthy")] * 10
    seq = int(time.time() * 1000)
    report = {"SourceId": "app-watchdog", "Property": "worker", "HealthState": "Error", "SequenceNumber": seq,
              "Description": "worker wedged"}
    assert agent.post("/v1/health/reports", report).status_code == 200
    assert app_health(agent) == "Unhealthy"
    assert "worker wedged" in agent.get("/app-health").json()["reason"]
    assert agent.post("/v1/health/reports", {**report, "HealthState": "Ok", "SequenceNumber": seq + 1}).status_code \
        == 200
    assert app_health(agent) == "Healthy"
    assert agent.get("/probe").status_code == 503


def test_app_health_is_healthy_while_the_event_started_reports_error(start_emulator, start_agent) -> None:
    """The `health` handler may report Error once maintenance started: still no reason to reimage the VM."""
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"handlers": HANDLERS["handlers"][1:]})
    eid = emu.add_event(event_type="Freeze", resources=["vm-1"], notice=300)
    emu.admin("POST", f"events/{eid}/start")
    wait_until(lambda: agent.get("/v1/health").json()["AggregatedHealthState"] == "Error", 15,
               "the health handler's Error once Started")
    assert app_health(agent) == "Healthy"
