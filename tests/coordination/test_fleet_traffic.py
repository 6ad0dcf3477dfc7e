"""O(N) coordination: who asks whom, how often, and what a push or a garbage answer changes."""

from __future__ import annotations

import pytest
import requests
import responses

from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.peers.peer_client import INVALID
from agent.health.health_store import HealthStore
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.coordination.test_coordinator import answer, make_coordinator, peer, step, tracked, view
from tests.imds_server import wait_for
from tests.samples import sample
from tests.stopping import stopped_at_end

VMS = [f"vm{i}" for i in range(1, 7)]


@pytest.fixture
def peers():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def asks(peers, name: str, eid: str = "E1") -> int:
    return sum(1 for c in peers.calls if c.request.method == "GET" and c.request.url == f"{peer(name)}/v1/events/{eid}")


def run(coord, t, vm, clock, seconds: int, pending=lambda t: []) -> None:
    for _ in range(seconds):
        step(coord, t, vm, pending=pending)
        clock.advance(1)


def test_the_leader_asks_a_slow_peer_with_backoff_not_every_second(tmp_path, clock, peers):
    """A peer preparing for two minutes is asked about a dozen times, not 120; nobody else polls it."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, VMS)
    for name in VMS[1:]:
        answer(peers, name, ready=name != "vm6")
    run(coord, t, "vm1", clock, 120)
    assert asks(peers, "vm2") == 1, "a ready peer is asked once"
    assert 5 <= asks(peers, "vm6") <= 20
    assert sent == []


def test_a_follower_asks_only_the_leader_and_only_every_few_seconds(tmp_path, clock, peers):
    """vm4 (rank 3) watches the leader alone while it answers: no requests to vm2, vm3, vm5, vm6."""
    coord, _, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, VMS)
    for name in VMS:
        answer(peers, name, ready=False)
    peers.add(responses.POST, f"{peer('vm1')}/v1/events/E1/peer-ready", json={"asked_again": True})
    run(coord, t, "vm4", clock, 60)
    assert [asks(peers, n) for n in ("vm2", "vm3", "vm5", "vm6")] == [0, 0, 0, 0]
    assert 10 <= asks(peers, "vm1") <= 15, "every liveness interval (takeover_after / 4, at most 5 s)"
    assert sum(1 for c in peers.calls if c.request.method == "POST") == 1, "one push to the leader"


def test_a_ready_said_by_a_leader_now_silent_is_no_licence_to_post(tmp_path, clock, peers):
    """The leader answers ready, then falls silent (it may be alive and posting behind a one-way
    partition): with `wait`, vm2 takes over but never POSTs on that old answer (S2)."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2"])
    answer(peers, "vm1", ready=True)
    peers.add(responses.POST, f"{peer('vm1')}/v1/events/E1/peer-ready", json={})
    run(coord, t, "vm2", clock, 10)
    peers.replace(responses.GET, f"{peer('vm1')}/v1/events/E1", body=requests.ConnectionError("down"))
    run(coord, t, "vm2", clock, 200)
    assert sent == [] and coord.view("E1")["acting_leader"] is None


def test_with_ignore_a_follower_takes_over_within_peer_timeout_of_the_leaders_last_answer(tmp_path, clock, peers):
    """The leader answers, then dies: with ignore (peer_timeout = takeover_after = 60 s) vm2 approves
    60 s after its last answer, not later."""
    coord, sent, _ = make_coordinator(tmp_path, clock, unreachable_peers="ignore", peer_timeout=60.0)
    t = tracked(clock, ["vm1", "vm2"])
    answer(peers, "vm1", ready=True)
    peers.add(responses.POST, f"{peer('vm1')}/v1/events/E1/peer-ready", json={})
    start = clock.monotonic()
    run(coord, t, "vm2", clock, 10)
    last_answer = 5  # asked at 0 and 5; dead from 6 s on
    peers.replace(responses.GET, f"{peer('vm1')}/v1/events/E1", body=requests.ConnectionError("down"))
    for _ in range(70):
        step(coord, t, "vm2")
        if sent:
            break
        clock.advance(1)
    assert sent == [["E1"]]
    assert last_answer + 60 <= clock.monotonic() - start <= last_answer + 62


def test_a_follower_pushes_to_rank_1_once_the_leader_is_gone(tmp_path, clock, peers):
    """vm3 learns vm1 is unreachable and tells vm2, the next in the chain, that it is ready."""
    coord, _, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    answer(peers, "vm1", status=0)
    answer(peers, "vm2", ready=False)
    peers.add(responses.POST, f"{peer('vm2')}/v1/events/E1/peer-ready", json={"asked_again": True})
    run(coord, t, "vm3", clock, 5)
    assert coord.view("E1")["readiness_pushed_to"] == "vm2"
    assert coord.view("E1")["acting_leader"] == "vm2"


def test_a_flood_of_hints_makes_the_leader_ask_at_most_once_per_poll_interval(tmp_path, clock, peers):
    """Unauthenticated pushes cannot make the leader hammer a peer: 100 hints, one extra ask."""
    coord, _, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2"])
    answer(peers, "vm2", ready=False)
    step(coord, t, "vm1")
    clock.advance(0.5)
    accepted = 0
    for _ in range(100):
        accepted += coord.hint("E1", "vm2")
        step(coord, t, "vm1")
    assert accepted == 1 and asks(peers, "vm2") == 2


@pytest.mark.parametrize("body", ['{"ready": "yes"}', '[true]', '{"ready": 1}', "ready", "[" * 5000 + "]" * 5000,
                                  '{"ready": true' + " " * 300_000 + "}"])
def test_a_garbage_answer_counts_as_not_ready_and_is_counted(tmp_path, clock, peers, body, logs):
    """A peer answering 200 with nonsense is never ready: no approval, outcome `invalid`, one log line."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2"])
    peers.add(responses.GET, f"{peer('vm2')}/v1/events/E1", body=body, status=200)
    run(coord, t, "vm1", clock, 5)
    assert sent == []
    assert sample(coord.metrics, "maintd_peer_requests_total", outcome=INVALID) >= 1
    assert coord.view("E1")["peers"]["vm2"]["ready"] is False
    assert len([e for e in logs if e["event"] == "peer.invalid_answer"]) == 1


def test_two_peers_at_one_address_never_lend_each_other_readiness(tmp_path, clock, peers, logs):
    """vm2 and vm3 given one URL (a peers-file copy-paste): vm3's agent answering ready does not make vm2 ready."""
    coord, sent, _ = make_coordinator(tmp_path, clock, peers={"vm2": peer("vm3"), "vm3": peer("vm3")})
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    peers.add(responses.GET, f"{peer('vm3')}/v1/events/E1", json=view("vm3", vm_name="VM3"))
    run(coord, t, "vm1", clock, 30)
    assert sent == []
    shown = coord.view("E1")["peers"]
    assert shown["vm3"]["ready"] is True and shown["vm2"]["ready"] is False
    assert "answered as 'VM3'" in shown["vm2"]["detail"]
    assert [e["peer"] for e in logs if e["event"] == "peer.invalid_answer"] == ["vm2"]


def test_a_peer_answering_under_its_own_name_is_ready(tmp_path, clock, peers):
    """The name check compares without case, as Resources does: `VM2` answering for vm2 counts."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2"])
    peers.add(responses.GET, f"{peer('vm2')}/v1/events/E1", json=view("vm2", vm_name="VM2"))
    run(coord, t, "vm1", clock, 3)
    assert sent == [["E1"]]


def test_resource_names_that_are_not_host_names_get_no_request_and_no_token(tmp_path, clock, peers):
    """`127.0.0.1:19999/steal?x=` in Resources is never turned into an address: it stays unreachable."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    coord.backend.peers.client.token_reader = lambda: "secret"
    t = tracked(clock, ["vm1", "127.0.0.1:19999/steal?x=", "a/../b"])
    run(coord, t, "vm1", clock, 3)
    assert [c.request.url for c in peers.calls] == [] and sent == []
    assert "not a host name" in coord.view("E1")["peers"]["a/../b"]["detail"]


def test_a_healthy_fleet_of_six_sends_one_post(tmp_path, clock, peers):
    """Every follower ready: the leader approves once, after one ask per peer."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, VMS)
    for name in VMS[1:]:
        answer(peers, name, ready=True)
    run(coord, t, "vm1", clock, 5)
    assert sent == [["E1"]]
    assert len(peers.calls) == len(VMS) - 1


def test_peers_file_problems_are_reported_in_health_and_a_fix_is_used_at_once(tmp_path, clock, peers, logs):
    """A broken peers file keeps the last good map (Warning health report); the fixed one is asked at once."""
    path = tmp_path / "peers.yaml"
    path.write_text("vm2: http://old.invalid:1\n")
    health = HealthStore(clock)
    sent: list = []
    coord = Coordinator(CoordinationConfig(peers_file=str(path)), approve=sent.append, store=Store(tmp_path, clock),
                        clock=clock, metrics=Metrics(), health=health)
    stopped_at_end(coord)
    peers.add(responses.GET, "http://old.invalid:1/v1/events/E1", body=requests.ConnectionError("down"))
    peers.add(responses.GET, "http://new.invalid:2/v1/events/E1", json=view("vm2"))
    t = tracked(clock, ["vm1", "vm2"])
    wait_for(lambda: step(coord, t, "vm1")  # the first look
             or coord.backend.peers.address("vm2").url == "http://old.invalid:1")
    run(coord, t, "vm1", clock, 20)
    path.write_text("vm2: [broken\n")  # the watcher's thread sees it within a second; the ticks go on meanwhile
    wait_for(lambda: step(coord, t, "vm1") or any(e.report.source_id == "coordination" for e in health.snapshot()))
    assert coord.backend.peers.address("vm2").url == "http://old.invalid:1"
    path.write_text("vm2: http://new.invalid:2\n")
    wait_for(lambda: step(coord, t, "vm1") or coord.backend.peers.address("vm2").url == "http://new.invalid:2")
    step(coord, t, "vm1")
    assert sent == [["E1"]], "the new address was asked at once, not after the backoff"
    assert not any(e.report.source_id == "coordination" for e in health.snapshot())
    assert [e["event"] for e in logs if e["event"].startswith("peers_file.")] == \
        ["peers_file.loaded", "peers_file.invalid", "peers_file.loaded"]


def test_a_leader_blip_starts_no_storm_but_a_long_outage_warms_the_next_leader(tmp_path, clock, peers):
    """vm2 sees the leader fail once: it asks nobody else. Only after half of takeover_after does it
    start asking the higher-ranked peers, so it knows who is ready when it takes over (here with
    `ignore`, peer_timeout = takeover_after, the one setting in which a taker posts for a silent leader)."""
    coord, sent, _ = make_coordinator(tmp_path, clock, unreachable_peers="ignore", peer_timeout=60.0)
    t = tracked(clock, VMS)
    answer(peers, "vm1", status=0)
    for name in VMS[2:]:
        answer(peers, name, ready=True)
    run(coord, t, "vm2", clock, 25)
    assert sum(asks(peers, n) for n in VMS[2:]) == 0
    run(coord, t, "vm2", clock, 10)
    assert all(asks(peers, n) == 1 for n in VMS[2:])
    assert sent == []
    run(coord, t, "vm2", clock, 30)
    assert sent == [["E1"]]


def test_an_exception_nobody_foresaw_while_asking_is_not_ready_and_the_peer_is_asked_again(tmp_path, clock, peers):
    """Finding 7 for peers: a TypeError deep in the exchange is `invalid`, and the peer is not stuck in flight."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2"])
    peers.add(responses.GET, f"{peer('vm2')}/v1/events/E1", body=TypeError("odd"))
    run(coord, t, "vm1", clock, 3)
    assert sample(coord.metrics, "maintd_peer_requests_total", outcome=INVALID) >= 2 and sent == []
    peers.replace(responses.GET, f"{peer('vm2')}/v1/events/E1", json=view("vm2"))
    run(coord, t, "vm1", clock, 5)
    assert sent == [["E1"]]
