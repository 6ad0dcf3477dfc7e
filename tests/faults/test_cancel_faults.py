"""An event that leaves the document while it is being prepared for: the preparation is cut, the
VM is back in rotation at once, and the completed phase runs (real `maintd run` and emulator)."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e

TRAP_TERM = ("import os, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: (open(os.environ['OUT'], 'a').write('TERM\\n'), sys.exit(3)))\n"
             "open(os.environ['OUT'], 'a').write('started\\n')\n"
             "time.sleep(600)\n")
RECORD = "import os\nopen(os.environ['OUT'], 'a').write(os.environ['MAINTD_OUTCOME'] + '\\n')\n"


def lines(path):
    return path.read_text().split() if path.exists() else []


def restore_hook(out):
    return {"name": "restore", "type": "exec", "phases": ["completed"], "command": [sys.executable, "-c", RECORD],
            "env": {"OUT": str(out)}}


def test_cancel_during_the_drain_wait_restores_rotation_at_once(start_emulator, start_agent, tmp_path):
    """The LB wait (30 s) is cut when the event is canceled: /probe 200 again and the completed hook ran."""
    done = tmp_path / "completed"
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {
        "probe": {"lb_timeout": "30s", "lb_interval": "5s", "drain_grace": "0s"},
        "handlers": [{"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]}, restore_hook(done)]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    wait_until(lambda: agent.get("/probe").status_code == 503, 20, "the drain")
    emu.admin("POST", f"events/{eid}/cancel")
    wait_until(lambda: agent.get("/probe").status_code == 200, 15, "back in rotation well before the 30 s LB wait")
    wait_until(lambda: lines(done) == ["canceled"], 15, "the completed hook")
    agent.wait_log("handler.finished", event_id=eid, handler="drain", phase="scheduled", outcome="canceled")
    results = agent.get(f"/v1/events/{eid}").json()["results"]
    assert results["handler:drain:scheduled"]["outcome"] == "canceled"
    assert not emu.approvals(), "nothing approved for an event that is gone"


def test_cancel_cuts_a_running_hook_and_skips_the_rest(start_emulator, start_agent, tmp_path):
    """A checkpoint hook gets SIGTERM when its event is canceled; the next hook never starts."""
    ckpt, done = tmp_path / "ckpt", tmp_path / "completed"
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"handlers": [
        {"name": "ckpt", "type": "exec", "phases": ["scheduled"], "command": [sys.executable, "-c", TRAP_TERM],
         "env": {"OUT": str(ckpt)}, "timeout": "10m"},
        {"name": "after", "type": "exec", "phases": ["scheduled"], "command": ["/bin/true"]},
        restore_hook(done)]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=900)
    wait_until(lambda: lines(ckpt) == ["started"], 20, "the checkpoint hook to start")
    emu.admin("POST", f"events/{eid}/cancel")
    wait_until(lambda: lines(ckpt) == ["started", "TERM"], 15, "SIGTERM to reach the hook")
    wait_until(lambda: lines(done) == ["canceled"], 15, "the completed hook")
    agent.wait_log("handler.finished", event_id=eid, handler="after", outcome="skipped")
    results = agent.get(f"/v1/events/{eid}").json()["results"]
    assert results["handler:ckpt:scheduled"]["outcome"] == "canceled"
    assert "left the document" in results["handler:after:scheduled"]["detail"]
