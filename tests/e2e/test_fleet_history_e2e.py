"""Fleet history with real agents and a real Azurite (each VM through its own counting proxy): after an event,
`maintd fleet --history` shows each VM once with its time out of rotation and prepared-before-start, and the
event's summary line; a VM killed -9 mid-event and restarted still records once; each VM writes its history at
most twice (here once). With the peer backend, the command says that fleet history needs the store."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.azurite import ACCOUNT, Azurite, azurite  # noqa: F401 - the fixture
from tests.cli.test_cli import maintd
from tests.e2e.harness import wait_until
from tests.e2e.test_store_e2e import FLEX, hook, store_config
from tests.store_chaos import ProxyConfig
from tests.store_proxy import StoreProxy

pytestmark = pytest.mark.e2e

VMS = FLEX[:3]
DRAIN = {"name": "drain", "type": "drain", "phases": ["scheduled", "started", "completed"]}
PROBE = {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"}


def history_note(agent: Any, eid: str) -> str | None:
    try:
        note = agent.state()["results"].get(eid, {}).get("history")
    except (OSError, ValueError):
        return None
    return note.get("status") if isinstance(note, dict) else None


def test_after_an_event_each_vm_is_in_the_fleet_history_once_even_one_killed_mid_event(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    container = azurite.new_container()
    emu = start_emulator(VMS)
    done = tmp_path / "done"
    done.mkdir()
    proxies = {vm: StoreProxy(azurite.url, ACCOUNT) for vm in VMS}
    try:
        agents = {}
        for vm in VMS:
            config = {**store_config(ProxyConfig(proxies[vm]), container,  # type: ignore[arg-type]
                                     tmp_path / f"{vm}-conf"), **hook(1.0, done), "probe": PROBE}
            config["handlers"] = [DRAIN, *config["handlers"]]
            agents[vm] = start_agent(emu, vm, config)
        eid = emu.add_event(event_type="Reboot", resources=VMS, notice=300)
        wait_until(lambda: all(a.get("/probe").status_code == 503 for a in agents.values()), 30, "every VM drained")
        sent = wait_until(lambda: next((e for a in agents.values() for e in a.events("approval.sent")
                                         if e.get("event_id") == eid), None), 60, "the early approval")
        victim = next(vm for vm in VMS if vm != sent["by"])
        killed = agents[victim]
        killed.proc.send_signal(signal.SIGKILL)  # mid-event: drained, approved, not back yet
        killed.proc.wait(10)
        killed.start()
        wait_until(lambda: killed.get("/probe").status_code == 503, 15, "the restarted VM still drained")
        emu.admin("POST", f"events/{eid}/complete")
        wait_until(lambda: all(history_note(a, eid) in ("recorded", "existed") for a in agents.values()), 60,
                   "every VM's history written")
        wait_until(lambda: all(a.get("/probe").status_code == 200 for a in agents.values()), 15, "back in rotation")

        answer = maintd("fleet", "--history", "--json", "--url", agents[VMS[0]].base)
        assert answer.returncode == 0, answer.stderr
        body = json.loads(answer.stdout)
        event = next((e for e in body["events"] if e["event_id"] == eid.lower()), body)
        assert sorted(v["vm"] for v in event.get("vms", [])) == sorted(VMS), json.dumps(body)  # each VM once
        for v in event["vms"]:
            assert v["prepared_before_start"] is True, v
            assert v["out_seconds"] is not None and v["out_seconds"] >= 11, v
            assert v["chosen_or_forced"] is None
        assert event["approved_by"] == sent["by"] and event["not_before"] is not None
        summary = event["summary"]
        assert summary["vms"] == 3 and summary["most_out_at_once"] == 3
        assert summary["not_prepared_before_start"] == []
        assert summary["longest_out_seconds"] == max(v["out_seconds"] for v in event["vms"])

        text = maintd("fleet", "--history", "--since", "1d", "--url", agents[VMS[1]].base)
        assert text.returncode == 0, text.stderr
        assert "3 VMs, at most 3 out at once, longest out of rotation" in text.stdout
        assert "all prepared before start" in text.stdout
        assert all(vm in text.stdout for vm in VMS) and "'" not in text.stdout

        for vm, proxy in proxies.items():  # the history's writes: at most 2 per VM per event (here 1)
            writes = [r for r in proxy.requests() if r.method == "PUT" and r.blob.startswith("history/")]
            assert 1 <= len(writes) <= 2, (vm, writes)
        restarted = [r for r in proxies[victim].requests() if r.method == "PUT" and r.blob.startswith("history/")]
        assert len(restarted) == 1
    finally:
        for proxy in proxies.values():
            proxy.stop()


def test_with_the_peer_backend_fleet_history_says_it_needs_the_store(start_emulator, start_agent) -> None:
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1")
    answer = maintd("fleet", "--history", "--url", agent.base)
    assert answer.returncode == 1
    assert "fleet history needs the store backend" in answer.stderr
    assert "maintd events --history" in answer.stderr
