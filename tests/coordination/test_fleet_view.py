"""`maintd fleet` on the peer backend: each VM's state as this VM learned it from the peers' answers."""

from __future__ import annotations

from agent.coordination.coordination_rules import PeerState
from agent.coordination.peers.peer_exchange import peer_fleet


def test_peers_that_answered_ready_not_ready_or_never_are_ready_preparing_and_not_seen() -> None:
    """This VM by its own readiness; a peer that answered ready, one that answered not ready, one never heard
    from; and this VM's approval record as who approved and when."""
    peers = {"vm2": PeerState(ready=True, last_ok=1.0), "vm3": PeerState(last_ok=1.0), "vm4": PeerState()}
    view = peer_fleet("E1", ("VM1", "vm2", "vm3", "vm4", "vm5"), "vm1", True, peers,
                      {"status": "sent", "by": "vm1", "at": "2026-11-25T12:00:00+00:00"})
    assert {v["name"]: v["state"] for v in view["vms"]} == {
        "VM1": "ready", "vm2": "ready", "vm3": "preparing", "vm4": "not seen", "vm5": "not seen"}
    assert view["approval"] == {"by": "vm1", "state": "sent", "at": "2026-11-25T12:00:00+00:00"}
    assert peer_fleet("E1", ("vm1",), "vm1", False, {}, None)["vms"] == [{"name": "vm1", "state": "preparing"}]
