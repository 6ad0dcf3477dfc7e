"""The disruption budget with real agents, the emulator and Azurite: a wave of separate events spread out in
time, one member out at a time, the late ones forced at their last safe moment, the store down; a release hands
the place to the next member, which leaves within seconds with no hint at all (B4: the next in line reads the
record every second), and a hint that cannot reach it is only counted."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.azurite import Azurite, azurite, start  # noqa: F401 - the fixture
from tests.cli.test_cli import maintd
from tests.e2e.harness import Agent, free_port, wait_until
from tests.e2e.test_store_e2e import metric, store_config

pytestmark = pytest.mark.e2e

VMS = ["web_a1", "web_b2", "web_c3", "web_d4"]
DRAIN = {"probe": {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"},
         "handlers": [{"name": "drain", "type": "drain", "phases": ["scheduled", "completed"], "timeout": "30s"}]}


class ProbeSampler:
    """Every member's /probe every 100 ms: who was down together. A probe that fails to answer (a loaded host)
    is counted, not taken for down or up, and never ends the sampling; `close` checks it sampled throughout."""

    def __init__(self, agents: dict[str, Agent]) -> None:
        self.agents = agents
        self.most_down = 0
        self.ever_down: set[str] = set()
        self.rounds = 0
        self.unanswered = 0
        self.downs: list[set[str]] = []
        """Who was down, each round."""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _down(self, agent: Agent) -> bool | None:
        try:
            return agent.get("/probe").status_code != 200
        except requests.RequestException:
            self.unanswered += 1
            return None

    def _run(self) -> None:
        while not self.stop.is_set():
            down = {vm for vm, a in self.agents.items() if self._down(a)}
            self.downs.append(down)
            self.most_down = max(self.most_down, len(down))
            self.ever_down |= down
            self.rounds += 1
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive(), "the probe sampler did not stop"
        assert self.unanswered <= self.rounds // 10, f"{self.unanswered} probes of {self.rounds} rounds unanswered"


def budget(server: Azurite, container: str, workdir: Path, port: int, **config: Any) -> dict[str, Any]:
    """The member's config: the store, the budget (it takes wake hints on its own port: the test agents listen
    on loopback, where `advertise: auto` is none), the drain."""
    cfg = store_config(server, container, workdir, budget={"group": "web", "max_unavailable": 1,
                                                           "advertise": f"http://127.0.0.1:{port}",
                                                           "rejoin_wait": "1s", **config})
    return {**cfg, **DRAIN}


def members(start_agent, emu, azurite: Azurite, tmp_path: Path, vms: list[str], **config: Any) -> dict[str, Agent]:
    container = azurite.new_container()
    ports = {vm: free_port() for vm in vms}
    return {vm: start_agent(emu, vm, budget(azurite, container, tmp_path / f"{vm}-conf", ports[vm], **config),
                            port=ports[vm]) for vm in vms}


def wave(start_emulator, start_agent, azurite: Azurite, tmp_path: Path, notice: float):
    emu = start_emulator(VMS)
    agents = members(start_agent, emu, azurite, tmp_path, VMS)
    sampler = ProbeSampler(agents)
    begun = time.time()  # NotBefore is `notice` after this, or a little later
    for vm in VMS:
        emu.add_event(event_type="Reboot", resources=[vm], notice=notice, duration_seconds=2)
    return emu, agents, sampler, begun


def approvals(emu, vm: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    return emu.approvals(vm)


def test_four_members_one_place_four_reboots_one_after_another_all_before_notbefore(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    """4 members, max_unavailable 1, 4 separate Reboots at once with 120 s notice: the probes are never down two
    at a time, every member was out, and all 4 are approved before NotBefore, one after another."""
    emu, agents, sampler, begun = wave(start_emulator, start_agent, azurite, tmp_path, 120)
    try:
        wait_until(lambda: all(approvals(emu, vm) for vm in VMS), 115, "all 4 approvals")
        wait_until(lambda: all(a.get("/probe").status_code == 200 for a in agents.values()), 30, "all back")
    finally:
        sampler.close()
    assert sampler.most_down == 1 and sampler.ever_down == set(VMS)
    times = sorted(approvals(emu, vm)[0]["time"] for vm in VMS)
    assert times[-1] < begun + 120
    assert all(b - a > 5 for a, b in zip(times, times[1:], strict=False))  # one after another, each drained first
    acquired = [e for a in agents.values() for e in a.events("budget.acquired")]
    assert len(acquired) == 4 and not [e for a in agents.values() for e in a.events("budget.forced")]
    fleet = json.loads(maintd("fleet", "--url", agents[VMS[0]].base, "--json").stdout)
    assert fleet["budget"]["group"] == "web" and fleet["budget"]["places"] == 1


def test_short_notice_late_members_are_forced_at_their_last_safe_moment_and_prepared_before_notbefore(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    """The same with 45 s notice: the late members are forced at their last safe moment, prepared (drained) before
    NotBefore, and counted as forced."""
    emu, agents, sampler, begun = wave(start_emulator, start_agent, azurite, tmp_path, 45)
    try:
        wait_until(lambda: all(approvals(emu, vm) for vm in VMS) or time.time() > begun + 50, 60, "approvals")
        wait_until(lambda: all(a.get("/probe").status_code == 200 for a in agents.values()), 40, "all back")
    finally:
        sampler.close()
    forced = [vm for vm, a in agents.items() if a.events("budget.forced")]
    assert forced, "nobody was forced with 45 s notice for 4 members one at a time"
    for vm in forced:
        drained = [e for e in agents[vm].events("handler.finished") if e.get("handler") == "drain"]
        assert drained and datetime.fromisoformat(drained[0]["timestamp"]).timestamp() < begun + 45, drained
    assert sampler.ever_down == set(VMS)
    text = agents[forced[0]].get("/metrics").text
    assert "maintd_budget_members" in text and "maintd_budget_wait_seconds" in text


def test_the_store_stopped_no_member_leaves_rotation_early_and_all_prepare_at_the_last_safe_moment(
        start_emulator, start_agent, tmp_path: Path) -> None:
    """Azurite stopped before the wave: nobody drains before its last safe moment (NotBefore - drain wait - 5 s),
    all are drained before NotBefore, and the budget Warning names the store."""
    server = start(tmp_path / "azurite")
    emu = start_emulator(VMS)
    agents = members(start_agent, emu, server, tmp_path, VMS)
    server.stop()
    begun = time.time()
    sampler = ProbeSampler(agents)
    for vm in VMS:
        emu.add_event(event_type="Reboot", resources=[vm], notice=45, duration_seconds=2)
    try:
        health = wait_until(lambda: (h := agents[VMS[0]].get("/v1/health").json()) and "budget" in json.dumps(h)
                            and h, 20, "the budget Warning")
        assert "Warning" in json.dumps(health) or "warning" in json.dumps(health)
        time.sleep(max(0.0, begun + 45 - 11 - 5 - 2 - time.time()))
        early = set(sampler.ever_down)
        wait_until(lambda: sampler.ever_down == set(VMS), 30, "every member drained")
    finally:
        sampler.close()
    assert not early, f"left rotation before the last safe moment: {early}"
    for vm, agent in agents.items():
        drained = wait_until(lambda a=agent: [e for e in a.events("handler.finished") if e.get("handler") == "drain"],
                             20, f"{vm} drained")
        assert datetime.fromisoformat(drained[0]["timestamp"]).timestamp() < begun + 46, (vm, drained)
        assert agent.events("budget.forced")


def test_a_member_killed_while_out_frees_its_place_after_release_after(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    """Two members, one place: the holder is killed -9 while out; the other takes the place once release_after
    (15 s, store time) has passed since the holder's last renewal (and its next read: a 5 s fallback poll here),
    and not before."""
    emu = start_emulator(VMS[:2])
    agents = members(start_agent, emu, azurite, tmp_path, VMS[:2], release_after="15s", fallback_poll="5s")
    first = VMS[0]
    emu.add_event(event_type="Reboot", resources=[first], notice=600, duration_seconds=2)
    agents[first].wait_log("budget.acquired", timeout=30)
    agents[first].kill()
    killed = time.time()
    emu.add_event(event_type="Reboot", resources=[VMS[1]], notice=600, duration_seconds=2)
    agents[VMS[1]].wait_log("budget.waiting", timeout=30)
    taken = agents[VMS[1]].wait_log("budget.acquired", timeout=60)
    assert taken and time.time() - killed > 10
    freed = [e for e in agents[VMS[1]].events("budget.released") if e.get("vm") == first]
    assert freed


def test_spread_zone_with_two_zones_never_both_zones_out(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    """4 members over 2 zones (IMDS compute zone), max_unavailable 2, spread zone, 4 Reboots at once: the members
    out at any moment are all of one zone, and every member is approved before NotBefore."""
    container = azurite.new_container()
    emu = start_emulator(VMS, "--zones", "2")
    zone = {vm: str(i % 2 + 1) for i, vm in enumerate(VMS)}
    ports = {vm: free_port() for vm in VMS}
    agents = {vm: start_agent(emu, vm, {**budget(azurite, container, tmp_path / f"{vm}-conf", ports[vm],
                                                 max_unavailable=2, spread="zone"), "identity": {"name": "auto"}},
                              port=ports[vm]) for vm in VMS}
    sampler = ProbeSampler(agents)
    begun = time.time()
    for vm in VMS:
        emu.add_event(event_type="Reboot", resources=[vm], notice=110, duration_seconds=2)
    try:
        wait_until(lambda: all(emu.approvals(vm) for vm in VMS), 105, "all 4 approvals")
    finally:
        sampler.close()
    zones_out = [{zone[vm] for vm in down} for down in sampler.downs]
    assert max(len(z) for z in zones_out) == 1, "two zones out at once"
    assert {z for s in zones_out for z in s} == {"1", "2"}
    assert all(emu.approvals(vm)[0]["time"] < begun + 110 for vm in VMS)


def handoff(start_emulator, start_agent, azurite: Azurite, tmp_path: Path, holder: dict[str, Any] | None = None,
            **second: Any) -> tuple[float, Any]:
    """Two members, one place, a 10-minute fallback poll: the first holds the place, the second waits; when the
    first is back in rotation (its release), how long until the second is out of rotation (its /probe down).
    `holder`, `second`: the holder's and the waiting member's own budget keys. The probes are never down together."""
    own = {VMS[0]: holder or {}, VMS[1]: second}
    emu = start_emulator(VMS[:2])
    container = azurite.new_container()
    ports = {vm: free_port() for vm in VMS[:2]}
    first, waiter = VMS[:2]
    agents = {vm: start_agent(emu, vm, budget(azurite, container, tmp_path / f"{vm}-conf", ports[vm],
                                              **({"fallback_poll": "10m"} | own[vm])),
                              port=ports[vm]) for vm in VMS[:2]}
    sampler = ProbeSampler(agents)
    try:
        emu.add_event(event_type="Reboot", resources=[first], notice=300, duration_seconds=2)
        agents[first].wait_log("budget.acquired", timeout=30)
        emu.add_event(event_type="Reboot", resources=[waiter], notice=300, duration_seconds=2)
        agents[waiter].wait_log("budget.waiting", timeout=30)
        released = agents[first].wait_log("budget.released", timeout=90)
        released_at = datetime.fromisoformat(released["timestamp"]).timestamp()
        wait_until(lambda: agents[waiter].get("/probe").status_code != 200, 240, f"{waiter} out of rotation")
        left = time.time() - released_at
    finally:
        sampler.close()
    assert sampler.most_down == 1
    assert agents[waiter].events("budget.acquired") and not agents[waiter].events("budget.forced")
    return left, agents[first]


def test_a_release_hands_the_place_over_and_the_next_member_leaves_within_seconds_with_no_hint(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    """No wake_url (the default: no hint is sent, as where members cannot reach each other) and a 10-minute
    fallback poll: the waiting member, first in line, reads the record every second and is out of rotation within
    a few seconds of the holder's release (the figure goes to bench/budget.py)."""
    left, first = handoff(start_emulator, start_agent, azurite, tmp_path)
    print(f"\nrelease -> next member out of rotation, no hint: {left:.2f} s")
    assert left < 20, f"{left:.1f} s from the release to the next member out of rotation"
    assert metric(first, "maintd_budget_wake_hints_total", outcome="sent") == 0


def test_a_hint_that_cannot_reach_the_member_is_only_counted(
        start_emulator, start_agent, azurite: Azurite, tmp_path: Path) -> None:
    """The releaser's wake_url gives an address where nothing listens: the hint fails (counted), and the waiting
    member's own reads still find the place the release handed it within seconds."""
    left, first = handoff(start_emulator, start_agent, azurite, tmp_path,
                          holder={"wake_url": f"http://127.0.0.1:{free_port()}/{{name}}"})
    print(f"\nrelease -> next member out of rotation, hint unreachable: {left:.2f} s")
    assert left < 20, f"{left:.1f} s from the release to the next member out of rotation"
    # counted once its last try failed (about 6 s of retries), which may be after the fallback read
    wait_until(lambda: metric(first, "maintd_budget_wake_hints_total", outcome="failed") >= 1, 30,
               "the unreachable hint counted as failed")
