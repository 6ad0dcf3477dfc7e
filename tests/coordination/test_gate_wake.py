"""A held gate lets go as soon as its input changes (issue 35 #3): the remote queries keep their pace, the decision
does not wait for them. With an injected clock that never moves, the POST follows a peer's word that its health
changed, or this VM's own report clearing; a follower says so to its leader each time its health word changes;
Prometheus is asked at most once per gate_recheck_delay, and not at all while the fleet holds the approval."""

from __future__ import annotations

import json

import pytest
import responses

from agent.coordination.approval_gates import GateChecker
from agent.coordination.coordination_rules import health_word, unwell
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.peers.peer_client import PeerClient
from agent.health.health_store import HealthState, HealthStore
from agent.model.gate_specs import FleetGate, Gates, PrometheusGate
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.coordination.test_coordinator import answer, peer, step, tracked
from tests.stopping import stopped_at_end

PROM = "http://prometheus.invalid:9090"
FLEET = Gates(fleet=FleetGate(max_percent_unhealthy=0))
ERROR = {"HealthEvents": [{"SourceId": "app", "Property": "queue", "HealthState": "Error", "IsExpired": False}]}
OK = {"HealthEvents": [{"SourceId": "app", "Property": "queue", "HealthState": "Ok", "IsExpired": False}]}


@pytest.fixture
def peers():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def leader(tmp_path, clock, gates=FLEET, health=None):  # type: ignore[no-untyped-def]
    """vm1's coordinator, the approvals it sends and the times it woke the loop."""
    sent: list[list[str]] = []
    woken: list[int] = []
    coord = Coordinator(CoordinationConfig(peer_url="http://{name}.peers.invalid:8088"), approve=sent.append,
                        store=Store(tmp_path, clock), clock=clock, metrics=Metrics(), gates=gates, health=health,
                        local_health=(lambda: health.to_json()) if health is not None else lambda: {"HealthEvents": []},
                        on_change=lambda: woken.append(1))
    stopped_at_end(coord)
    return coord, sent, woken


def health_reads(peers, name: str) -> int:
    return sum(1 for c in peers.calls if c.request.url == f"{peer(name)}/v1/health")


def test_a_peers_word_that_its_health_changed_opens_the_held_gate_with_no_time_passing(tmp_path, clock, peers):
    coord, sent, woken = leader(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    for name in ("vm2", "vm3"):
        answer(peers, name)
    peers.add(responses.GET, f"{peer('vm2')}/v1/health", json=ERROR)
    peers.add(responses.GET, f"{peer('vm3')}/v1/health", json=OK)
    step(coord, t, "vm1")  # the peers answer ready
    step(coord, t, "vm1")
    assert sent == [] and coord.view("E1")["approval_held"]["gate"] == "fleet"
    for _ in range(20):  # woken again and again (answers, outcomes): the held gate is not asked again
        step(coord, t, "vm1")
    assert (health_reads(peers, "vm2"), health_reads(peers, "vm3")) == (1, 1)
    assert not coord.health_hint("E1", "vm9"), "a VM the event does not name is no news"
    peers.replace(responses.GET, f"{peer('vm2')}/v1/health", json=OK)
    woken.clear()
    assert coord.health_hint("E1", "VM2") and woken, "the word wakes the loop"
    assert not coord.health_hint("E1", "vm2"), "the same word again, before it is read, wakes nothing"
    step(coord, t, "vm1")
    assert sent == [["E1"]], "sent on the pass the word woke, not after the 5 s recheck"
    assert health_reads(peers, "vm2") == 3 and health_reads(peers, "vm3") == 2, \
        "the peer that spoke read again, then every VM afresh before the POST"


def test_a_word_that_changes_nothing_costs_one_read_and_holds(tmp_path, clock, peers):
    coord, sent, _ = leader(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    for name in ("vm2", "vm3"):
        answer(peers, name)
        peers.add(responses.GET, f"{peer(name)}/v1/health", json=ERROR)
    step(coord, t, "vm1")  # the peers answer ready
    step(coord, t, "vm1")
    assert coord.health_hint("E1", "vm3")
    step(coord, t, "vm1")
    assert sent == [] and (health_reads(peers, "vm2"), health_reads(peers, "vm3")) == (1, 2)
    assert "vm2 (unhealthy)" in coord.view("E1")["approval_held"]["reason"]


def test_this_vms_own_report_clearing_wakes_the_loop_and_the_approval_goes_out(tmp_path, clock):
    health = HealthStore(clock)
    health.set("app", "queue", HealthState.ERROR, "queue depth 12000")
    coord, sent, woken = leader(tmp_path, clock, health=health)
    t = tracked(clock, ["vm1"])
    step(coord, t, "vm1")
    assert sent == [] and "vm1 (unhealthy)" in coord.view("E1")["approval_held"]["reason"]
    woken.clear()
    health.set("app", "queue", HealthState.WARNING, "still deep")  # Warning does not count here: news all the same
    assert woken
    step(coord, t, "vm1")
    assert sent == [["E1"]]


def test_a_ready_follower_tells_its_leader_each_time_its_health_word_changes(tmp_path, clock, peers):
    health = HealthStore(clock)
    coord = Coordinator(CoordinationConfig(peer_url="http://{name}.peers.invalid:8088"), approve=lambda ids: None,
                        store=Store(tmp_path, clock), clock=clock, metrics=Metrics(), health=health,
                        local_health=health.to_json)
    stopped_at_end(coord)
    t = tracked(clock, ["vm1", "vm2"])
    answer(peers, "vm1", ready=False)
    peers.add(responses.POST, f"{peer('vm1')}/v1/events/E1/peer-ready", json={"asked_again": True})

    def pushed() -> list[dict]:
        return [json.loads(c.request.body) for c in peers.calls if c.request.method == "POST"]

    for _ in range(3):
        step(coord, t, "vm2")
    assert pushed() == [{"vm": "vm2"}], "readiness once; its health then is what the leader reads itself"
    health.set("app", "queue", HealthState.ERROR, "deep")
    step(coord, t, "vm2")
    step(coord, t, "vm2")
    health.set("app", "queue", HealthState.WARNING, "shallower")
    step(coord, t, "vm2")
    health.remove("app", "queue")
    step(coord, t, "vm2")
    assert pushed()[1:] == [{"vm": "vm2", "health": "unhealthy"}, {"vm": "vm2", "health": "warning"},
                            {"vm": "vm2", "health": "ok"}]


@responses.activate
def test_prometheus_is_asked_at_its_pace_and_not_while_the_fleet_holds(tmp_path, clock):
    health = HealthStore(clock)
    health.set("app", "queue", HealthState.ERROR, "deep")
    gates = Gates(fleet=FleetGate(max_percent_unhealthy=0), prometheus=PrometheusGate(url=PROM, alerts=("NodeDown",)))
    coord, sent, _ = leader(tmp_path, clock, gates=gates, health=health)
    responses.add(responses.GET, f"{PROM}/api/v1/alerts", json={"data": {"alerts": [
        {"labels": {"alertname": "NodeDown"}, "state": "firing"}]}})
    t = tracked(clock, ["vm1"])
    step(coord, t, "vm1")
    assert coord.view("E1")["approval_held"]["gate"] == "fleet" and len(responses.calls) == 0
    health.remove("app", "queue")
    step(coord, t, "vm1")
    assert coord.view("E1")["approval_held"]["gate"] == "prometheus" and len(responses.calls) == 1
    for second in range(30):  # the fleet's input changes every second: Prometheus still at most every 5 s
        health.set("app", "flap", HealthState.ERROR if second % 2 else HealthState.OK, "flapping")
        step(coord, t, "vm1")
        clock.advance(1)
    assert len(responses.calls) <= 1 + 30 / 5 and sent == []


def test_on_the_store_a_listing_that_changes_the_fleet_input_is_news() -> None:
    listing = {"vm1": "ok", "vm2": "unhealthy"}
    checker = GateChecker(PeerClient(lambda: None, 1.0, 1), lambda n: None, lambda: None, 1, Metrics(),
                          fleet_states=lambda eid, resources, vm, wae: {n: listing[n] for n in resources})
    assert checker.check(FLEET, "E1", ["vm1", "vm2"], "vm1", False) is not None
    assert not checker.moved("E1")
    listing["vm2"] = "ok"
    assert checker.moved("E1") and checker.check(FLEET, "E1", ["vm1", "vm2"], "vm1", False) is None
    checker.follow([])
    assert not checker.moved("E1")


def test_the_words_a_follower_says_and_the_reports_that_wake():
    assert health_word(ERROR, "E1") == "unhealthy" and health_word(OK, "E1") == "ok"
    warning = {"HealthEvents": [{"SourceId": "app", "Property": "q", "HealthState": "Warning"}]}
    assert health_word(warning, "E1") == "warning" and health_word("garbage", "E1") == "unreachable"
    assert unwell(OK) == frozenset() and unwell(ERROR) == {("app", "queue", "Error")} and unwell(None) == frozenset()
