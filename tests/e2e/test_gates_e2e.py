"""Approval gates with real processes: a peer reporting Error holds the approval; a real Prometheus rule too."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from tests.e2e.harness import free_port, http, wait_until
from tests.e2e.test_coordination_e2e import VMS, all_approvals, fleet
from tests.reaper import die_with_parent

pytestmark = pytest.mark.e2e


def test_no_approval_while_a_peer_reports_error_then_sent_when_it_clears(start_emulator, start_agent):
    gates = {"gates": {"fleet": {"max_percent_unhealthy": 0}}}
    emu, agents = fleet(start_emulator, start_agent, lambda vm: gates)
    seq = int(time.time() * 1000)
    report = {"SourceId": "app-watchdog", "Property": "queue", "HealthState": "Error", "SequenceNumber": seq,
              "Description": "queue depth 12000"}
    assert agents["vm-3"].post("/v1/health/reports", report).status_code == 200
    eid = emu.add_event(event_type="Reboot", resources=VMS, notice=300)
    held = agents["vm-1"].wait_log("approval.held", event_id=eid)
    assert held["gate"] == "fleet" and "vm-3" in held["reason"]
    view = agents["vm-1"].get(f"/v1/events/{eid}").json()
    assert view["approval_held"]["gate"] == "fleet"
    wait_until(lambda: 'maintd_approval_gate_blocked{gate="fleet"} 1.0' in agents["vm-1"].get("/metrics").text, 15,
               "the gate gauge")
    assert not all_approvals(emu)
    agents["vm-3"].post("/v1/health/reports", {**report, "HealthState": "Ok", "SequenceNumber": seq + 1})
    agents["vm-1"].wait_log("approval.sent", event_id=eid)
    assert len(all_approvals(emu)) == 1


PROMETHEUS = shutil.which("prometheus")
RULES = """groups:
  - name: maintd-e2e
    interval: 1s
    rules:
      - alert: MaintenanceBlocker
        expr: vector(time()) < {until}
"""


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed (.ci/run installs it)")
def test_a_firing_prometheus_alert_holds_the_approval_until_it_stops(start_emulator, start_agent, tmp_path):
    """A real Prometheus on 127.0.0.1 with a rule that fires until the test rewrites it (a fixed end raced a slow
    start-up on a loaded host: the alert could be over before the event came)."""
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES.format(until=time.time() + 3600))
    (tmp_path / "prometheus.yml").write_text("global: {evaluation_interval: 1s}\nrule_files: [rules.yml]\n")
    port = free_port()
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        url = f"http://127.0.0.1:{port}"
        session = http()

        def alert_firing() -> bool:
            try:
                alerts = session.get(f"{url}/api/v1/alerts", timeout=1).json()["data"]["alerts"]
            except Exception:
                return False
            return any(a["labels"]["alertname"] == "MaintenanceBlocker" and a["state"] == "firing" for a in alerts)

        wait_until(alert_firing, 30, "the Prometheus alert to fire")
        emu = start_emulator(["vm-1"], "--started-duration", "1")
        agent = start_agent(emu, "vm-1", {"gates": {"prometheus": {"url": url, "alerts": ["MaintenanceBlocker"]}}})
        eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
        held = agent.wait_log("approval.held", event_id=eid)
        assert held["gate"] == "prometheus" and "MaintenanceBlocker" in held["reason"]
        polls = len(emu.requests("vm-1"))
        wait_until(lambda: len(emu.requests("vm-1")) >= polls + 20, 20, "20 more polls while the alert fires")
        assert not emu.approvals("vm-1")
        rules.write_text(RULES.format(until=0))  # the rule fires no more once Prometheus reloads it
        lifted = time.time()
        prom.send_signal(signal.SIGHUP)
        agent.wait_log("approval.sent", event_id=eid, timeout=30)
        assert [a["time"] >= lifted for a in emu.approvals("vm-1")] == [True], "sent only once the rule stopped firing"
    finally:
        prom.terminate()
        prom.wait(10)
