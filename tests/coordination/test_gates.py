"""Approval gates: the fleet percentage rule, peer health reading, the Prometheus gate, and holding."""

from __future__ import annotations

import pytest
import requests
import responses

from agent.config.config import loads
from agent.coordination.approval_gates import GateChecker
from agent.coordination.coordination_rules import (
    allowed_unhealthy,
    firing,
    fleet_verdict,
    peer_state,
)
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.coordination.peers.peer_client import PeerClient
from agent.errors import ConfigError
from agent.model.gate_specs import FleetGate, Gates, PrometheusGate
from agent.policy.approval_policy import Profile
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.coordination.test_coordinator import peer, step, tracked
from tests.samples import sample
from tests.stopping import stopped_at_end

PROM = "http://prometheus.invalid:9090"


# --- the percentage rule -----------------------------------------------------------------------

@pytest.mark.parametrize("total, percent, allowed", [
    (3, 10, 1),     # rounds up: one failure tolerated in a small fleet
    (10, 10, 1), (11, 10, 2), (100, 10, 10), (1, 0, 0), (5, 0, 0), (7, 100, 7), (0, 50, 0),
])
def test_allowed_unhealthy_rounds_up(total, percent, allowed):
    assert allowed_unhealthy(total, percent) == allowed


def test_fleet_verdict_holds_only_beyond_the_tolerated_share():
    gate = FleetGate(max_percent_unhealthy=20)
    assert fleet_verdict({"a": "ok", "b": "ok", "c": "unhealthy"}, gate) is None  # 1 of 3 ≤ ceil(0.6)
    held = fleet_verdict({"a": "unhealthy", "b": "ok", "c": "unhealthy"}, gate)
    assert held and held.gate == "fleet" and "2 of 3" in held.reason and "a (unhealthy)" in held.reason
    assert fleet_verdict({"a": "ok"}, FleetGate(max_percent_unhealthy=0)) is None
    assert fleet_verdict({"a": "unhealthy"}, FleetGate(max_percent_unhealthy=0)) is not None
    assert fleet_verdict({"a": "unhealthy", "b": "unhealthy"}, FleetGate(max_percent_unhealthy=100)) is None


def test_unreachable_counts_as_error_by_default_or_is_left_out():
    states = {"a": "ok", "b": "unreachable", "c": "unreachable"}
    assert fleet_verdict(states, FleetGate(max_percent_unhealthy=33)) is not None
    assert fleet_verdict(states, FleetGate(max_percent_unhealthy=0, unreachable_counts_as="ignore")) is None


def report(source, prop, state, expired=False):
    return {"SourceId": source, "Property": prop, "HealthState": state, "IsExpired": expired}


def test_peer_state_ignores_the_reports_about_the_event_itself():
    """A VM that is only draining (and reporting) for this very event is healthy for its gate."""
    body = {"HealthEvents": [report("maintd", "maintenance/E1", "Error"), report("maintenance", "pending", "Ok")]}
    assert peer_state(body, "E1", False) == "ok"
    assert peer_state(body, "E2", False) == "unhealthy", "another event's maintenance report still counts"
    assert peer_state({"HealthEvents": [report("app", "q", "Warning")]}, "E1", False) == "ok"
    assert peer_state({"HealthEvents": [report("app", "q", "Warning")]}, "E1", True) == "unhealthy"
    assert peer_state({"HealthEvents": [report("app", "q", "Ok", expired=True)]}, "E1", False) == "unhealthy"
    assert peer_state("garbage", "E1", False) == "unreachable"


def test_firing_matches_names_and_regexes_in_full():
    body = {"data": {"alerts": [{"labels": {"alertname": "NodeDown"}, "state": "firing"},
                                {"labels": {"alertname": "DiskFull"}, "state": "pending"},
                                {"labels": {"alertname": "HighLatencyEU"}, "state": "firing"}]}}
    assert firing(body, ["NodeDown"]) == ["NodeDown"]
    assert firing(body, ["High.*"]) == ["HighLatencyEU"]
    assert firing(body, ["DiskFull", "Node"]) == [], "pending alerts and partial names do not block"


# --- config ------------------------------------------------------------------------------------

def test_gates_config_top_level_and_per_profile():
    cfg = loads("gates:\n  fleet: {max_percent_unhealthy: 10}\n"
                "profiles:\n  - {name: default, approval: auto, "
                "gates: {prometheus: {url: 'http://p:9090', alerts: [X]}}}\n")
    assert cfg.gates.fleet.max_percent_unhealthy == 10
    assert cfg.profiles[0].gates.prometheus.alerts == ("X",)


@pytest.mark.parametrize("text, key", [
    ("gates:\n  fleet: {max_percent_unhealthy: 101}\n", "gates.fleet.max_percent_unhealthy"),
    ("gates:\n  prometheus: {url: 'http://p:9090'}\n", "gates.prometheus.alerts"),
    ("gates:\n  prometheus: {url: 'http://p:9090', alerts: ['(']}\n", "gates.prometheus.alerts[0]"),
    ("gates:\n  fleet: {max_percent_unhealthy: 5, unreachable_counts_as: maybe}\n",
     "gates.fleet.unreachable_counts_as"),
])
def test_bad_gates_are_refused_naming_the_key(text, key):
    with pytest.raises(ConfigError) as err:
        loads(text, "maintd.yaml")
    assert err.value.key == key and err.value.line is not None


# --- the checker -------------------------------------------------------------------------------

def checker(local=None, metrics=None):
    return GateChecker(PeerClient(lambda: None, 1.0, 4), lambda n: peer(n), lambda: local or {"HealthEvents": []},
                       4, metrics or Metrics())


@responses.activate
def test_prometheus_gate_blocks_on_firing_alerts_queries_and_failures():
    gate = Gates(prometheus=PrometheusGate(url=PROM, alerts=("Node.*",), query="up == 0"))
    responses.add(responses.GET, f"{PROM}/api/v1/alerts", json={"data": {"alerts": [
        {"labels": {"alertname": "NodeDown"}, "state": "firing"}]}})
    held = checker().check(gate, "E1", ["vm1"], "vm1", False)
    assert held and held.gate == "prometheus" and "NodeDown" in held.reason

    responses.replace(responses.GET, f"{PROM}/api/v1/alerts", json={"data": {"alerts": []}})
    responses.add(responses.GET, f"{PROM}/api/v1/query", json={"data": {"result": [{"metric": {}, "value": [0, "1"]}]}})
    assert "returned 1" in checker().check(gate, "E1", ["vm1"], "vm1", False).reason

    responses.replace(responses.GET, f"{PROM}/api/v1/query", json={"data": {"result": []}})
    assert checker().check(gate, "E1", ["vm1"], "vm1", False) is None

    responses.replace(responses.GET, f"{PROM}/api/v1/query", status=500)
    assert "on_failure: block" in checker().check(gate, "E1", ["vm1"], "vm1", False).reason
    lenient = Gates(prometheus=PrometheusGate(url=PROM, query="up == 0", on_failure="ignore"))
    assert checker().check(lenient, "E1", ["vm1"], "vm1", False) is None


@responses.activate
def test_fleet_gate_reads_every_peers_health():
    responses.add(responses.GET, f"{peer('vm2')}/v1/health", json={"HealthEvents": [report("app", "db", "Error")]})
    responses.add(responses.GET, f"{peer('vm3')}/v1/health", body=requests.ConnectionError("down"))
    gates = Gates(fleet=FleetGate(max_percent_unhealthy=33))
    held = checker().check(gates, "E1", ["vm1", "vm2", "vm3"], "vm1", False)
    assert held and "vm2 (unhealthy)" in held.reason and "vm3 (unreachable)" in held.reason
    assert checker().check(Gates(fleet=FleetGate(max_percent_unhealthy=34, unreachable_counts_as="ignore")),
                           "E1", ["vm1", "vm2", "vm3"], "vm1", False) is None


# --- holding in the coordinator ----------------------------------------------------------------

@responses.activate
def test_a_held_approval_is_visible_and_goes_out_once_the_gate_opens(tmp_path, clock, logs):
    sent: list[list[str]] = []
    metrics = Metrics()
    coord = Coordinator(CoordinationConfig(peer_url="http://{name}.peers.invalid:8088"), approve=sent.append,
                        store=Store(tmp_path, clock), clock=clock, metrics=metrics,
                        gates=Gates(prometheus=PrometheusGate(url=PROM, alerts=("NodeDown",))))
    stopped_at_end(coord)
    responses.add(responses.GET, f"{PROM}/api/v1/alerts", json={"data": {"alerts": [
        {"labels": {"alertname": "NodeDown"}, "state": "firing"}]}})
    t = tracked(clock, ["vm1"])
    profile = Profile(name="default", approval="auto")
    step(coord, t, "vm1", profile=profile)
    assert sent == []
    view = coord.view("E1")
    assert view["approval_held"]["gate"] == "prometheus"
    assert any(e["event"] == "approval.held" for e in logs)
    step(coord, t, "vm1", profile=profile)
    assert sample(metrics, "maintd_approval_gate_blocked", gate="prometheus") == 1
    responses.replace(responses.GET, f"{PROM}/api/v1/alerts", json={"data": {"alerts": []}})
    clock.advance(5)  # a held approval's gates are asked again after gate_recheck_delay (5 s by default)
    step(coord, t, "vm1", profile=profile)
    assert sent == [["E1"]] and coord.view("E1")["approval_held"] is None
    step(coord, t, "vm1", profile=profile)
    assert sample(metrics, "maintd_approval_gate_blocked", gate="prometheus") == 0


@responses.activate
def test_a_profile_without_gates_overrides_nothing_and_one_with_gates_replaces_them(tmp_path, clock):
    sent: list[list[str]] = []
    coord = Coordinator(CoordinationConfig(), approve=sent.append, store=Store(tmp_path, clock), clock=clock,
                        metrics=Metrics())
    stopped_at_end(coord)
    responses.add(responses.GET, f"{PROM}/api/v1/alerts", json={"data": {"alerts": [
        {"labels": {"alertname": "Freeze"}, "state": "firing"}]}})
    strict = Profile(name="window", approval="auto",
                     gates=Gates(prometheus=PrometheusGate(url=PROM, alerts=("Freeze",))))
    step(coord, tracked(clock, ["vm1"]), "vm1", profile=strict)
    assert sent == []
    clock.advance(5)
    step(coord, tracked(clock, ["vm1"]), "vm1", profile=Profile(name="default", approval="auto"))
    assert sent == [["E1"]]


# --- odd answers (finding 7) ---------------------------------------------------------------------

@responses.activate
@pytest.mark.parametrize("alerts,query", [({"data": {"alerts": 5}}, None), ({"data": []}, None),
                                          ({"data": {"alerts": []}}, {"data": {"result": 5}}),
                                          ({"data": {"alerts": [{"state": "firing", "labels": []}]}},
                                           {"data": {"result": {"x": 1}}})])
def test_an_odd_prometheus_answer_holds_is_counted_and_does_not_raise(alerts, query):
    responses.add(responses.GET, f"{PROM}/api/v1/alerts", json=alerts)
    responses.add(responses.GET, f"{PROM}/api/v1/query", json=query)
    metrics = Metrics()
    held = checker(metrics=metrics).check(Gates(prometheus=PrometheusGate(url=PROM, alerts=("X",), query="up")),
                                          "E1", ["vm1"], "vm1", False)
    assert held and held.gate == "prometheus"
    assert sample(metrics, "maintd_gate_check_failures_total", gate="prometheus") == 1


@responses.activate
def test_a_peer_health_state_that_is_a_list_makes_it_unhealthy_not_a_crash():
    responses.add(responses.GET, f"{peer('vm2')}/v1/health",
                  json={"HealthEvents": [{"SourceId": "app", "HealthState": ["Ok"]}]})
    held = checker().check(Gates(fleet=FleetGate(max_percent_unhealthy=0)), "E1", ["vm1", "vm2"], "vm1", False)
    assert held and "vm2 (unhealthy)" in held.reason


def test_a_gate_that_raises_holds_the_approval_and_is_asked_again_shortly(tmp_path, clock, logs):
    """Anything unforeseen while reading a gate: held, logged, counted; once it answers, the POST goes out."""
    sent: list[list[str]] = []
    metrics = Metrics()
    coord = Coordinator(CoordinationConfig(), approve=sent.append, store=Store(tmp_path, clock), clock=clock,
                        metrics=metrics, gates=Gates(fleet=FleetGate(max_percent_unhealthy=0)))
    stopped_at_end(coord)
    failing = [True]

    def local_health():
        if failing[0]:
            raise TypeError("odd")
        return {"HealthEvents": []}

    coord.gate_checker.local_health = local_health
    t = tracked(clock, ["vm1"])
    step(coord, t, "vm1")
    assert sent == [] and coord.view("E1")["approval_held"]["gate"] == "fleet"
    assert sample(metrics, "maintd_gate_check_failures_total", gate="fleet") == 1
    assert any(e["event"] == "gate.check_failed" for e in logs)
    failing[0] = False
    clock.advance(5)
    step(coord, t, "vm1")
    assert sent == [["E1"]]


# --- issue 28 #5: a held gate is asked at a bounded pace ----------------------------------------

@responses.activate
@pytest.mark.parametrize("answer", [{"json": {"data": {"alerts": [{"labels": {"alertname": "NodeDown"},
                                                                     "state": "firing"}]}}},
                                    {"body": requests.ConnectionError("refused")}], ids=["firing", "failing"])
def test_a_held_gate_is_asked_at_most_once_per_recheck_interval_however_often_the_loop_is_woken(
        tmp_path, clock, logs, answer):
    """The daemon ticks after every poll and at once when woken (the approver wakes it after each
    outcome). 20 s of a firing alert (or a failing Prometheus): at most one query every 5 s
    (approval_retry_for 60 s / 12), not hundreds a second, and one gate.check_failed line."""
    woken = []
    coord = Coordinator(CoordinationConfig(), approve=lambda ids: None, store=Store(tmp_path, clock), clock=clock,
                        metrics=Metrics(), on_change=lambda: woken.append(1),
                        gates=Gates(prometheus=PrometheusGate(url=PROM, alerts=("NodeDown",))))
    stopped_at_end(coord)
    responses.add(responses.GET, f"{PROM}/api/v1/alerts", **answer)
    t = tracked(clock, ["vm1"])
    profile = Profile(name="default", approval="auto")
    for _ in range(20):
        step(coord, t, "vm1", profile=profile)
        for _ in range(50):  # as the daemon does: a wake right after a poll decides again at once
            if not woken:
                break
            woken.clear()
            step(coord, t, "vm1", profile=profile)
        clock.advance(1)
    assert 3 <= len(responses.calls) <= 5
    assert len([e for e in logs if e["event"] == "gate.check_failed"]) == (1 if "body" in answer else 0)
