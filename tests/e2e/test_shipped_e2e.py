"""The shipped config/maintd.yaml in a real `maintd run` against the emulator: a VM whose operator has not
configured preparation yet is observed, never approved early (issue 35: it used to POST at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parents[2] / "config" / "maintd.yaml"


def shipped() -> dict[str, Any]:
    """The shipped file as the harness's overrides: the harness points imds.endpoint, state.dir and
    server.listen at the emulator, a temporary directory and a free port; JSON logs, so they can be read."""
    cfg = yaml.safe_load(SHIPPED.read_text())
    return {**{k: v for k, v in cfg.items() if k not in ("state", "server")}, "log": {**cfg["log"], "format": "json"}}


def test_the_shipped_config_sends_no_approval_before_not_before(start_emulator, start_agent):
    """A Reboot with 20 s notice: maintd sees it, says it does not approve it (the profile's `never`), and the
    event starts at its NotBefore with no StartRequests POST from this VM."""
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", shipped())
    event_id = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=20)
    agent.wait_log("event.appeared", timeout=30, event_id=event_id)
    skipped = agent.wait_log("approval.skipped", timeout=30, event_id=event_id)
    assert skipped["mode"] == "never"
    agent.wait_log("event.status_changed", timeout=60, event_id=event_id)
    started = [e for e in emu.admin("GET", "events", "vm-1")["Events"] if e["EventId"] == event_id]
    assert not started or started[0]["EventStatus"] == "Started"
    assert emu.approvals() == [], "the shipped config approved an event early"
