"""The `alertmanager` handler end to end: the emulator, a real `maintd run` and a real Alertmanager (Debian's
prometheus-alertmanager) on 127.0.0.1. The VM's alert is silenced from the moment it leaves rotation, a
restart of maintd mid-event leaves exactly one silence, and once the event is over and the VM is back in
rotation the alert is no longer silenced."""

from __future__ import annotations

import pytest

from tests.alertmanager import alertmanagers, needs_alertmanager  # noqa: F401 (fixture)
from tests.e2e.harness import wait_until

pytestmark = [pytest.mark.e2e, needs_alertmanager]
INSTANCE = "vm-1:9100"


def test_the_vms_alert_is_silenced_during_maintenance_across_a_restart_and_not_after(start_emulator, start_agent,
                                                                                      alertmanagers):
    (am,) = alertmanagers(1)
    am.fire(instance=INSTANCE)
    am.fire(instance="vm-2:9100")
    emu = start_emulator(["vm-1"], "--started-duration", "4")
    agent = start_agent(emu, "vm-1", {
        "probe": {"lb_timeout": "20s", "lb_interval": "5s", "drain_grace": "0s"},
        "handlers": [
            {"name": "silence", "type": "alertmanager", "phases": ["scheduled", "started", "completed"],
             "urls": [am.url], "matchers": ['instance=~"{vm}(:[0-9]+)?"'], "margin": "2m", "recheck": "1s"},
            {"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]}]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
    wait_until(lambda: agent.get("/probe").status_code == 503, 20, "the VM to leave rotation")
    silenced = wait_until(lambda: am.silenced_by(instance=INSTANCE), 20, "the VM's alert to be silenced")
    assert am.silenced_by(instance="vm-2:9100") == []
    (silence,) = am.live()
    assert silenced == [silence["id"]] and silence["createdBy"] == "maintd@vm-1" and eid in silence["comment"]
    note = wait_until(lambda: agent.get(f"/v1/events/{eid}").json()["results"].get("note:silence", {})
                      .get("silences", {}).get(am.url, {}).get("id") == silence["id"]
                      and agent.get(f"/v1/events/{eid}").json()["results"]["note:silence"], 20,
                      "the silence id in /v1/events/{id}")
    assert note["silences"][am.url]["ends_at"] and silence["id"] in note["summary"]
    status = agent.get("/v1/status").json()["notes"][eid]  # what `maintd status` prints
    assert status.startswith("silence: ") and silence["id"] in status and note["silences"][am.url]["ends_at"] in status

    agent.stop()  # mid-event: the drain's wait is cut short and runs again after the restart
    agent.start()
    agent.wait_log("handler.started", event_id=eid, handler="drain")
    assert [s["id"] for s in am.live()] == [silence["id"]], "a restart never makes a second silence"

    agent.wait_log("event.completed", event_id=eid, timeout=60)
    wait_until(lambda: agent.get("/probe").status_code == 200, 20, "the VM back in rotation")
    wait_until(lambda: not am.silenced_by(instance=INSTANCE), 20, "the silence to be expired")
    assert am.live() == []
    made = am.silences("expired")
    assert silence["id"] in [s["id"] for s in made]
    assert len(made) == 1, "made active right before the VM left rotation (the drain runs next); no other"
