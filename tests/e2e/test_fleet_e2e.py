"""Fleet coordination with real agents: scale-set names, the peers file, and O(N) traffic at N=10."""

from __future__ import annotations

import json
import sys

import pytest

from tests.cli.test_cli import maintd
from tests.e2e.harness import free_port, wait_until

pytestmark = pytest.mark.e2e


def peer_requests(agent) -> float:
    """Every request this agent sent to a peer (asks and pushes), from its /metrics."""
    text = agent.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("maintd_peer_requests_total{"))


def test_scale_set_peers_are_reached_through_the_computer_names_derived_from_imds(start_emulator, start_agent,
                                                                                  tmp_path):
    """Resources name web_1..web_3; each agent learns its own scale set and computer name from IMDS
    compute metadata and derives web000002 for web_2, which an inventory-style peers file maps to a port."""
    vms = ["web_1", "web_2", "web_3"]
    emu = start_emulator(vms)
    ports = {vm: free_port() for vm in vms}
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({f"web00000{vm[-1]}": f"http://127.0.0.1:{p}" for vm, p in ports.items()}))
    agents = {vm: start_agent(emu, vm, {"identity": {"name": "auto"}, "coordination": {"peers_file": str(inventory)}},
                              port=ports[vm]) for vm in vms}
    eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
    agents["web_1"].wait_log("approval.sent", event_id=eid)
    assert [a["vm"] for vm in vms for a in emu.approvals(vm)] == ["web_1"]
    view = agents["web_1"].get(f"/v1/events/{eid}").json()
    assert view["peers"]["web_3"]["url"] == f"http://127.0.0.1:{ports['web_3']}"
    assert view["peers"]["web_3"]["via"] == "peers_file" and view["peers"]["web_3"]["ready"]
    status = agents["web_2"].get("/v1/status").json()
    assert status["coordination"]["identity"] == {"name": "web_2", "computer_name": "web000002", "scale_set": "web"}


def test_a_fixed_peers_file_is_picked_up_and_a_broken_one_keeps_the_last_good_map(start_emulator, start_agent,
                                                                                  tmp_path):
    """vm-1 cannot reach vm-2 (wrong port): no approval; garbage in the file is reported and changes
    nothing; the right port in the file is used at once and the one approval goes out."""
    vms = ["vm-1", "vm-2"]
    emu = start_emulator(vms)
    ports = {vm: free_port() for vm in vms}
    peers_file = tmp_path / "peers.yaml"
    peers_file.write_text("vm-2: http://127.0.0.1:9\n")  # discard: nothing listens (a free_port() may be taken)
    leader = start_agent(emu, "vm-1", {"coordination": {"peers_file": str(peers_file), "request_timeout": "500ms"}},
                         port=ports["vm-1"])
    start_agent(emu, "vm-2", {"coordination": {"peers": {"vm-1": f"http://127.0.0.1:{ports['vm-1']}"}}},
                port=ports["vm-2"])
    eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
    leader.wait_log("approval.skipped", event_id=eid)
    wait_until(lambda: leader.get(f"/v1/events/{eid}").json()["peers"].get("vm-2", {}).get("unreachable_seconds"),
               10, "vm-2 to count as unreachable")
    shown = maintd("status", "--url", leader.base).stdout
    assert f"Peers of {eid}" in shown and "(via peers_file): ConnectionError" in shown, shown
    peers_file.write_text("vm-2: [not, a, url]\n")
    leader.wait_log("peers_file.invalid")
    status = leader.get("/v1/status").json()
    assert "vm-2" in status["coordination"]["peers_file_problem"] and status["coordination"]["peers_file_entries"] == 1
    health = leader.get("/v1/health").json()
    assert any(r["SourceId"] == "coordination" and r["HealthState"] == "Warning" for r in health["HealthEvents"])
    assert not emu.approvals("vm-1")
    loaded = len(leader.events("peers_file.loaded"))  # the first load at start-up is one of them
    peers_file.write_text(f"vm-2: http://127.0.0.1:{ports['vm-2']}\n")
    wait_until(lambda: len(leader.events("peers_file.loaded")) > loaded, 20, "the fixed peers file loaded")
    leader.wait_log("approval.sent", event_id=eid, timeout=30)
    assert len(emu.approvals("vm-1")) + len(emu.approvals("vm-2")) == 1


def test_ten_agents_coordinate_with_requests_linear_in_n_not_every_peer_every_poll(start_emulator, start_agent):
    """N=10 agents polling every 100 ms, a 3 s hook on each: one POST, and the whole fleet sends a small
    multiple of N requests to peers (measured: 72; the all-ask-all-every-poll scheme before it: 1984)."""
    n = 10
    vms = [f"vm-{i:02d}" for i in range(1, n + 1)]
    emu = start_emulator(vms)
    ports = {vm: free_port() for vm in vms}
    peers = {vm: f"http://127.0.0.1:{p}" for vm, p in ports.items()}
    hook = {"handlers": [{"name": "checkpoint", "type": "exec", "phases": ["scheduled"],
                          "command": [sys.executable, "-c", "import time; time.sleep(3)"]}],
            "coordination": {"peers": peers, "request_timeout": "1s"}}
    agents = [start_agent(emu, vm, hook, port=ports[vm]) for vm in vms]
    before = sum(peer_requests(a) for a in agents)
    eid = emu.add_event(event_type="Reboot", resources=vms, notice=300)
    agents[0].wait_log("approval.sent", event_id=eid, timeout=60)
    total = sum(peer_requests(a) for a in agents) - before
    followers = [peer_requests(a) for a in agents[1:]]
    approvals = [a for vm in vms for a in emu.approvals(vm)]
    assert len(approvals) == 1 and approvals[0]["vm"] == "vm-01"
    assert total <= 15 * n, f"{total:.0f} peer requests for one event at N={n}"
    assert max(followers) <= 8, f"a follower sent {max(followers):.0f} requests: followers must not poll the fleet"
