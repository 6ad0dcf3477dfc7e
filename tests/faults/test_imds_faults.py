"""IMDS misbehaving, through the emulator's fault API: maintd stays up, says so, and loses nothing."""

from __future__ import annotations

import re
import sys

import pytest

from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e

FAULTS = {
    "timeout": ({"kind": "latency", "delay": 3}, "error"),
    "429 storm": ({"kind": "status", "status": 429, "retry_after": 1}, "429"),
    "500": ({"kind": "status", "status": 500}, "500"),
    "503": ({"kind": "status", "status": 503}, "503"),
    "404": ({"kind": "status", "status": 404}, "404"),
    "410": ({"kind": "status", "status": 410}, "410"),
    "proxy 504 html": ({"kind": "proxy_504"}, "504"),
    "malformed json": ({"kind": "malformed"}, "200"),
    "wrong content type": ({"kind": "wrong_content_type"}, "200"),
    "connection reset": ({"kind": "reset"}, "error"),
    "reset mid-body": ({"kind": "reset_mid_body"}, "error"),
    "trickle": ({"kind": "trickle", "delay": 0.5}, "error"),
    "deep json": ({"kind": "deep_json"}, "200"),
    "oversize": ({"kind": "oversize"}, "error"),
}
WAIT_FOR_GO = "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.05)\n"


def counter(agent, code):
    text = agent.get("/metrics").text
    m = re.search(rf'maintd_imds_requests_total{{code="{code}",endpoint="scheduledevents"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("fault, code", FAULTS.values(), ids=FAULTS.keys())
def test_maintd_survives_reports_and_catches_up(start_emulator, start_agent, tmp_path, fault, code):
    go = tmp_path / "go"
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {
        "imds": {"timeout": "1s", "warn_after_failures": 2},
        "handlers": [{"name": "checkpoint", "type": "exec", "phases": ["scheduled"],
                      "command": [sys.executable, "-c", WAIT_FOR_GO], "env": {"GO": str(go)}}]})
    first = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    agent.wait_log("handler.started", event_id=first)

    emu.admin("POST", "faults", path="/metadata/scheduledevents", **fault)
    wait_until(lambda: counter(agent, code) >= 2, 20, f"two failed polls counted with code {code}")
    go.touch()  # the VM becomes ready while IMDS misbehaves: no approval on stale data
    second = emu.add_event(event_type="Freeze", resources=["vm-1"], notice=600, duration_seconds=5)
    health = wait_until(lambda: (h := agent.get("/v1/health").json())["AggregatedHealthState"] != "Ok" and h,
                        20, "/v1/health to show the IMDS problem")
    assert any(e["SourceId"] == "imds" for e in health["HealthEvents"] if e["HealthState"] != "Ok")
    assert agent.get("/healthz").status_code == 200
    assert agent.get("/probe").status_code == 200, "an IMDS problem never takes the VM out of rotation"
    agent.wait_log("handler.finished", event_id=first, handler="checkpoint")
    polls = len(emu.requests("vm-1"))
    wait_until(lambda: len(emu.requests("vm-1")) >= polls + 2, 20, "more polls during the fault")
    assert not emu.approvals(), "nothing is approved while the last good document is stale"

    emu.admin("DELETE", "faults")
    agent.wait_log("poll.recovered", timeout=30)
    agent.wait_log("event.appeared", event_id=second, timeout=10)
    agent.wait_log("approval.sent", event_id=first, timeout=10)
    assert agent.proc.poll() is None
