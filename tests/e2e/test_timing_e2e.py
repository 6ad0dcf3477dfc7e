"""Preparation at the planned time: a real `maintd run` against `maintd emulate` on a scaled clock."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.e2e.harness import CLEAN_ENV, wait_until

pytestmark = pytest.mark.e2e

THREE_DAYS = 3 * 86400


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def hook(tmp_path, name):
    """An exec handler that appends the wall-clock time of each run to a file."""
    out = tmp_path / f"{name}.times"
    return out, {"name": name, "type": "exec", "phases": ["scheduled"],
                 "command": ["/bin/sh", "-c", f"date +%s.%N >> {out}"]}


def runs(path):
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def test_a_three_day_reboot_is_prepared_before_the_window_and_approved_inside_it(start_emulator, start_agent, tmp_path):
    """Three emulated days of notice pass in 70 s. Outside the window approval is `never`; the
    window (a fixed date 30–50 s from now, room for a slow start on a busy machine) allows `auto`.
    maintd holds the checkpoint until the window's start minus the 4 s lead time, then approves
    inside the window, not at first sight."""
    t0 = time.time()
    start, end = t0 + 30, t0 + 50
    emu = start_emulator(["vm-1"], "--time-scale", str(THREE_DAYS / 70),
                         "--started-duration", str(THREE_DAYS / 70))  # Started for 1 s
    times, checkpoint = hook(tmp_path, "checkpoint")
    agent = start_agent(emu, "vm-1", {
        "handlers": [checkpoint],
        "prepare": {"lead_time_by_type": {"Reboot": "4s"}},
        "profiles": [{"name": "window", "approval": "auto", "fixed_date": {"start": iso(start), "end": iso(end)}},
                     {"name": "default", "approval": "never"}]})
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=THREE_DAYS)
    made = agent.wait_log("plan.made", event_id=eid)
    assert (made["prepare_reason"], made["approve_reason"]) == ("window", "window")

    plan = agent.get(f"/v1/events/{eid}").json()["plan"]
    assert plan["preparation"] == "held" and plan["prepare_at"] == iso(start - 4)
    series = [line.split() for line in agent.get("/metrics").text.splitlines()
              if line.startswith("maintd_event_prepare_timestamp_seconds{")]
    assert [(labels, round(float(value))) for labels, value in series] == \
        [('maintd_event_prepare_timestamp_seconds{event_type="Reboot"}', round(start - 4))]
    table = subprocess.run([sys.executable, "-m", "agent", "events", "--url", agent.base],
                           capture_output=True, text=True, env=CLEAN_ENV, timeout=30).stdout
    assert "PREPARE" in table and "(window)" in table, table
    assert agent.get("/probe").status_code == 200, "in rotation while the preparation waits"

    agent.wait_log("approval.sent", event_id=eid, timeout=50)
    approved = emu.approvals("vm-1")[0]["time"]
    ran = runs(times)
    assert len(ran) == 1 and ran[0] >= start - 4 - 0.5, f"prepared {ran[0] - start:+.1f}s from the window's start"
    assert start <= approved < end, f"approved {approved - start:+.1f}s from the window's start"
    agent.wait_log("event.completed", event_id=eid, timeout=20)


def test_a_preempt_is_prepared_at_once_whatever_the_profile(start_emulator, start_agent, tmp_path):
    """A 30 s Preempt under a `never` profile with a 10 m lead time is prepared at first sight."""
    emu = start_emulator(["vm-1"])
    times, checkpoint = hook(tmp_path, "checkpoint")
    agent = start_agent(emu, "vm-1", {"handlers": [checkpoint], "prepare": {"lead_time": "10m"},
                                      "profiles": [{"name": "default", "approval": "never"}]})
    eid = emu.add_event(event_type="Preempt", resources=["vm-1"], notice=30)
    seen = time.time()
    agent.wait_log("handler.finished", event_id=eid, outcome="ok", timeout=30)
    assert runs(times)[0] - seen < 15, "prepared at first sight, well before NotBefore (30 s)"
    plan = wait_until(lambda: agent.get(f"/v1/events/{eid}").json().get("plan"), 10, "the plan")
    assert (plan["prepare_reason"], plan["approve_reason"]) == ("lead_time", "no_window")
    assert not emu.approvals("vm-1")
    assert timedelta(seconds=0) <= datetime.fromisoformat(plan["not_before"].replace("Z", "+00:00")) - \
        datetime.now(UTC) <= timedelta(seconds=30)
