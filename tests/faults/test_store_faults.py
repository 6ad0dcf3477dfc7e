"""The store backend under faults, with real agents and Azurite: a claimer killed before its POST, the store gone
mid-event, a VM that never becomes ready."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from tests.azurite import start
from tests.e2e.harness import wait_until
from tests.e2e.test_store_e2e import FLEX, hook, metric, store_config

pytestmark = pytest.mark.e2e


def approvals(emu, vms: list[str]) -> list[dict]:
    return [a for vm in vms for a in emu.approvals(vm)]


def fleet(start_emulator, start_agent, tmp_path: Path, server, hook_seconds: tuple[float, ...]):
    """Agents with Flexible names on one new container, each with a hook of its own length (and its
    `done` marker file): (emulator, VM names, agents by name, the done dir, the container)."""
    container = server.new_container()
    vms = FLEX[:len(hook_seconds)]
    emu = start_emulator(vms)
    done = tmp_path / "done"
    done.mkdir()
    agents = {vm: start_agent(emu, vm, {**store_config(server, container, tmp_path / f"{vm}-conf"),
                                        **hook(seconds, done)}) for vm, seconds in zip(vms, hook_seconds, strict=True)}
    return emu, vms, agents, done, container


def test_a_claimer_killed_between_claim_and_post_is_taken_over_with_one_post_in_all(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """The slowest VM claims; its POST hangs at IMDS; it is killed (SIGKILL) holding the claim. Another VM takes
    the claim over once it is takeover_after (4 s) old on the store's clock and sends the only POST."""
    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.5, 0.5, 2.0))
        claimer = vms[2]
        emu.admin("POST", "faults", claimer, vm=claimer, kind="hang", path="/metadata/scheduledevents",
                  method="POST")
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
        agents[claimer].wait_log("store.claimed", event_id=eid, timeout=30)
        killed_at = time.monotonic()
        agents[claimer].proc.send_signal(signal.SIGKILL)
        agents[claimer].proc.wait(5)
        wait_until(lambda: approvals(emu, vms), 40, "the takeover's approval")
        took = time.monotonic() - killed_at
        assert [a["vm"] for a in approvals(emu, vms)] != [claimer] and len(approvals(emu, vms)) == 1
        assert 3 <= took <= 4 + 10 + 5, f"takeover after {took:.1f}s"
        assert any(e.get("event_id") == eid for vm in vms[:2] for e in agents[vm].events("store.claimed"))
    finally:
        server.stop()


def test_the_store_gone_mid_event_holds_the_approval_warns_and_recovers(start_emulator, start_agent,
                                                                        tmp_path: Path) -> None:
    """Azurite stops while the last VM is still preparing: no POST, a Warning `coordination`/`store` report and
    store failures in the metric, and the polls keep their 100 ms cadence throughout; Azurite back (empty: in
    memory), the agents rewrite their markers by themselves and the one POST goes out."""
    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.2, 4.0))
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
        agents[vms[0]].wait_log("store.listed", event_id=eid, timeout=20)
        server.stop()
        down_at = time.time()
        slow = agents[vms[1]]
        slow.wait_log("store.request_failed", timeout=30)
        wait_until(lambda: (done / f"{vms[1]}.done").exists(), 20, "the slow hook")
        time.sleep(2)
        assert approvals(emu, vms) == []
        polls = [r["time"] for r in emu.requests(vms[1]) if "scheduledevents" in r["path"] and r["time"] >= down_at]
        assert max(b - a for a, b in zip(polls, polls[1:], strict=False)) < 0.5, "the poll loop waited on the store"
        health = slow.get("/v1/health").json()["HealthEvents"]
        assert any(r["SourceId"] == "coordination" and r["Property"] == "store" and r["HealthState"] == "Warning"
                   for r in health), health
        assert metric(slow, "maintd_store_requests_total", outcome="unreachable") > 0
        server.start()
        server.create_container(container)
        wait_until(lambda: approvals(emu, vms), 60, "the approval after the store came back")
        slow.wait_log("store.recovered", timeout=5)
        assert len(approvals(emu, vms)) == 1
    finally:
        server.stop()


def test_a_vm_that_never_becomes_ready_means_no_post_and_the_event_starts_at_not_before(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """One VM's hook never ends: nobody claims, no POST; the platform starts the event at NotBefore."""
    server = start(tmp_path)
    try:
        emu, vms, agents, done, container = fleet(start_emulator, start_agent, tmp_path, server, (0.2, 600))
        eid = emu.add_event(event_type="Reboot", resources=vms, notice=8)

        def started() -> bool:
            events = emu.admin("GET", "events", vms[0])["Events"]
            return bool(events) and events[0]["EventStatus"] == "Started"

        wait_until(started, 30, "the platform to start the event at NotBefore")
        assert eid
        assert approvals(emu, vms) == []
        assert not any(a.events("store.claimed") for a in agents.values())
    finally:
        server.stop()
