"""kill -9 at each step of an event's life, then restart: the interrupted hook runs again (at least
once, with MAINTD_ATTEMPT), finished ones are not repeated, the drain is kept, one POST."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e

RECORD_THEN_WAIT = ("import json, os, time\n"
                    "open(os.environ['OUT'], 'a')"
                    ".write(os.environ['HOOK'] + ':' + os.environ['MAINTD_ATTEMPT'] + '\\n')\n"
                    "while not os.path.exists(os.environ['GO']): time.sleep(0.05)\n")


def hook(name, out, go):
    return {"name": name, "type": "exec", "phases": ["scheduled"], "command": [sys.executable, "-c", RECORD_THEN_WAIT],
            "env": {"OUT": str(out), "GO": str(go), "HOOK": name}}


def runs(out):
    """Each run as HOOK:ATTEMPT."""
    return out.read_text().split() if out.exists() else []


def started(out):
    return [r.split(":")[0] for r in runs(out)]


@pytest.mark.parametrize("kill_during", ["first", "second"])
def test_kill_9_during_each_hook_then_restart(start_emulator, start_agent, tmp_path, kill_during):
    """The hook running at the kill runs again with MAINTD_ATTEMPT=2, the others once; one approval POST."""
    out = tmp_path / "runs"
    gates = {name: tmp_path / f"go-{name}" for name in ("first", "second", "third")}
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"handlers": [hook(n, out, g) for n, g in gates.items()]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    for name, go in gates.items():
        wait_until(lambda: name in started(out), 15, f"{name} to start")
        if name == kill_during:
            agent.kill()
            for g in gates.values():
                g.touch()
            agent.start()
            break
        go.touch()
    agent.wait_log("handler.interrupted", event_id=eid, handler=kill_during)
    wait_until(lambda: "third" in started(out), 15, "the remaining hooks to run")
    agent.wait_log("approval.sent", event_id=eid)
    polls = len(emu.requests("vm-1"))
    wait_until(lambda: len(emu.requests("vm-1")) >= polls + 5, 10, "a few more polls")
    assert sorted(runs(out)) == sorted(["first:1", "second:1", "third:1", f"{kill_during}:2"])
    assert len(emu.approvals("vm-1")) == 1, "prepared after all, and approved once"


def test_the_drain_survives_kill_9_and_lifts_when_the_event_is_gone(start_emulator, start_agent):
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {
        "probe": {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"},
        "handlers": [{"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]}]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    wait_until(lambda: agent.get("/probe").status_code == 503, 20, "the drain")
    agent.kill()
    agent.start()
    assert agent.get("/probe").status_code == 503, "out of rotation from the first request after the restart"
    emu.admin("POST", f"events/{eid}/start")
    emu.admin("POST", f"events/{eid}/complete")
    wait_until(lambda: agent.get("/probe").status_code == 200, 15, "back in rotation once the event is gone")


def test_kill_9_between_the_approval_post_and_its_record_sends_one_post(start_emulator, start_agent):
    """The POST is slow; maintd dies before recording the answer; after the restart no second POST."""
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1")
    # The approval POST hangs 6 s before IMDS starts the event: long enough that the restarted agent (slow to
    # start on a loaded host) still finds the event Scheduled, its own POST unconfirmed; well short of the 10 s
    # the restarted agent waits before it would send again.
    emu.admin("POST", "faults", kind="latency", delay=6, method="POST", count=1)
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    state = agent.workdir / "state" / "state.json"
    wait_until(lambda: state.exists() and '"sending"' in state.read_text(), 15, "the approval to be under way")
    # Kill only once IMDS has the POST (it then hangs): killed earlier, no POST was ever sent, and the
    # restarted agent rightly sends one after its 10 s wait, which would be a different case.
    wait_until(lambda: any(r["method"] == "POST" for r in emu.requests("vm-1")), 5, "the POST to reach IMDS")
    agent.kill()
    agent.start()
    agent.wait_log("approval.unconfirmed", event_id=eid)
    agent.wait_log("event.status_changed", event_id=eid, status="Started", timeout=20)
    polls = len(emu.requests("vm-1"))
    wait_until(lambda: len(emu.requests("vm-1")) >= polls + 5, 10, "a few more polls")
    assert len(emu.approvals("vm-1")) == 1
