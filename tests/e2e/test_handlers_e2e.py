"""Handlers driven by a real event: every phase once, the drain seen by the probe, at-most-once across
kill -9 for a hook that opts out of reruns."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e

RECORD = ("import json, os, sys\n"
          "with open(os.environ['OUT'], 'a') as f:\n"
          "    f.write(json.dumps({'phase': os.environ['MAINTD_PHASE'], 'id': os.environ['MAINTD_EVENT_ID'],"
          " 'stdin': json.load(sys.stdin)['event']['EventId'], 'name': os.environ['HOOK']}) + '\\n')\n")
WAIT_FOR_GO = "import os, time\nwhile not os.path.exists(os.environ['GO']): time.sleep(0.05)\n"


def hook(name, out, phases, **extra):
    return {"name": name, "type": "exec", "phases": phases, "command": [sys.executable, "-c", RECORD],
            "env": {"OUT": str(out), "HOOK": name}, **extra}


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_reboot_runs_every_phase_once_in_order(start_emulator, start_agent, tmp_path):
    out = tmp_path / "hooks.jsonl"
    # Started for 3 s: a poll stalled for longer than that on a loaded host would miss the Started phase
    emu = start_emulator(["vm-1"], "--started-duration", "3")
    agent = start_agent(emu, "vm-1", {"handlers": [hook("record", out, ["scheduled", "started", "completed"])]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=120)
    agent.wait_log("event.completed", event_id=eid)
    agent.wait_log("handler.finished", event_id=eid, phase="completed")
    runs = lines(out)
    assert [r["phase"] for r in runs] == ["scheduled", "started", "completed"]
    assert {r["id"] for r in runs} == {eid} and {r["stdin"] for r in runs} == {eid}
    scheduled_done = agent.wait_log("handler.finished", event_id=eid, phase="scheduled")
    assert scheduled_done["outcome"] == "ok"


def test_the_drain_takes_the_probe_out_before_approval_and_back_after(start_emulator, start_agent):
    """Probe 503 soon after the event (how soon is a figure for bench/, not a pass/fail bound on a loaded host),
    before any approval; approval only after probe.lb_timeout; 200 once it is gone."""
    emu = start_emulator(["vm-1"], "--started-duration", "1")
    agent = start_agent(emu, "vm-1", {"probe": {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"},
                                      "handlers": [{"name": "drain", "type": "drain",
                                                    "phases": ["scheduled", "completed"]}]})
    assert agent.get("/probe").status_code == 200
    t0 = time.monotonic()
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
    wait_until(lambda: agent.get("/probe").status_code == 503, 10, "the probe to answer 503 (well inside lb_timeout)")
    assert agent.get("/probe").text.startswith("draining")
    assert not emu.approvals("vm-1"), "out of rotation before the approval"
    agent.wait_log("approval.sent", event_id=eid, timeout=40)
    approved_after = time.monotonic() - t0
    assert approved_after >= 11, approved_after
    agent.wait_log("event.completed", event_id=eid, timeout=30)
    wait_until(lambda: agent.get("/probe").status_code == 200, 20, "the probe back to 200")


def test_kill_9_never_runs_a_hook_with_rerun_interrupted_false_twice(start_emulator, start_agent, tmp_path):
    """rerun_interrupted: false: the interrupted hook is failed, the VM not ready, and the view says what to do."""
    out, go = tmp_path / "hooks.jsonl", tmp_path / "go"
    first = hook("first", out, ["scheduled"])
    second = hook("second", out, ["scheduled"], rerun_interrupted=False)
    second["command"] = [sys.executable, "-c", RECORD + WAIT_FOR_GO]
    second["env"]["GO"] = str(go)
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"handlers": [first, second]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
    wait_until(lambda: len(lines(out)) == 2, 15, "both hooks to have started")
    agent.kill()
    go.touch()
    agent.start()
    interrupted = agent.wait_log("handler.interrupted", event_id=eid, handler="second")
    assert "not run again" in interrupted["action"]
    polls = len(emu.requests("vm-1"))
    wait_until(lambda: len(emu.requests("vm-1")) >= polls + 5, 10, "five more polls (room for a wrongful re-run)")
    assert [r["name"] for r in lines(out)] == ["first", "second"]
    view = agent.get(f"/v1/events/{eid}").json()
    assert view["results"]["handler:second:scheduled"]["outcome"] == "failed"
    assert view["ready"] is False, "on_failure: block keeps the VM from being ready"
    assert view["not_ready"] == [f"second failed (interrupted; rerun_interrupted: false); on_failure: block — "
                                 f"approve by hand with `maintd approve {eid}`"]
    assert not emu.approvals("vm-1")
