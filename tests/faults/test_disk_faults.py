"""A full or read-only state disk: maintd keeps serving, reports Error, and writes again once it can.

A real 1 MiB tmpfs holds the state dir (root only: mount needs CAP_SYS_ADMIN; CI runs as root).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.e2e.harness import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def state_health(agent):
    events = agent.get("/v1/health").json()["HealthEvents"]
    return {e["Property"]: e["HealthState"] for e in events if e["SourceId"] == "state"}


def test_full_disk_is_reported_and_recovered_without_losing_events(start_emulator, start_agent, small_disk):
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"state": {"dir": str(small_disk / "state")}})
    first = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    agent.wait_log("approval.sent", event_id=first)
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    second = emu.add_event(event_type="Freeze", resources=["vm-1"], notice=600, duration_seconds=5)
    agent.wait_log("state.write_failed", timeout=15)
    wait_until(lambda: state_health(agent).get("write") == "Error", 10, "state/write Error in /v1/health")
    assert agent.get("/healthz").status_code == 200
    assert any(e["EventId"] == second for e in agent.get("/v1/events").json()), "still serving from memory"
    assert "maintd_state_unsaved 1.0" in agent.get("/metrics").text

    filler.unlink()
    agent.wait_log("state.write_recovered", timeout=15)
    wait_until(lambda: state_health(agent).get("write") == "Ok", 10, "state/write Ok again")
    saved = json.loads((small_disk / "state" / "state.json").read_text())
    assert second in json.dumps(saved), "the change made while the disk was full reached it"


def test_read_only_state_dir_is_reported_and_recovered(start_emulator, start_agent, small_disk):
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"state": {"dir": str(small_disk / "state")}})
    agent.wait_log("daemon.started")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
        agent.wait_log("state.write_failed", timeout=15)
        assert agent.get("/healthz").status_code == 200
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    agent.wait_log("state.write_recovered", timeout=15)
    assert eid in (small_disk / "state" / "state.json").read_text()
