"""Coordination: one approval per event, peers asked boundedly, takeover after the leader is gone."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import requests
import responses

from agent.coordination.coordination_rules import (
    PeerState,
    acting_leader,
    liveness_interval,
    push_due,
    recheck_delay,
    watch_chain,
)
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.coordinator import Coordinator
from agent.health.health_store import HealthStore
from agent.loop.tick import Tick
from agent.model.events import Event
from agent.model.tracker import Tracked
from agent.policy.approval_policy import Profile
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.samples import sample
from tests.stopping import stopped_at_end

AUTO = Profile(name="default", approval="auto")


def peer(name: str) -> str:
    return f"http://{name}.peers.invalid:8088"


@pytest.fixture
def peers():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def make_coordinator(tmp_path, clock, health=None, **settings):
    """A coordinator on a fresh store, with the approvals it sends (named so pytest 7 never takes it
    for a nose `setup`)."""
    sent: list[list[str]] = []
    cfg = CoordinationConfig(peer_url="http://{name}.peers.invalid:8088", takeover_after=60.0, **settings)
    store = Store(tmp_path, clock)
    coord = Coordinator(cfg, approve=sent.append, store=store, clock=clock, metrics=Metrics(), poll_interval=1.0,
                        health=health)
    stopped_at_end(coord)
    return coord, sent, store


def tracked(clock, resources, status="Scheduled", eid="E1"):
    e = Event(eid, "Reboot", status, tuple(resources), not_before=clock.now() + timedelta(minutes=15))
    return {eid: Tracked(e, True, clock.now(), "b", False)}


def view(name, ready=True, **fields):
    """A peer's answer about E1 as maintd gives it: vmN names itself at rank N-1 (the tests' Resources order)."""
    return {"ready": ready, "names_self": True, "rank": int(name[2:]) - 1, **fields}


def answer(peers, name, ready=True, status=200, eid="E1"):
    if status == 0:
        peers.add(responses.GET, f"{peer(name)}/v1/events/{eid}", body=requests.ConnectionError("down"))
    else:
        peers.add(responses.GET, f"{peer(name)}/v1/events/{eid}", json=view(name, ready), status=status)


def step(coord, t, vm, pending=lambda t: [], profile=AUTO):
    """One tick, its requests and approval run to the end, and their outcomes taken as the next tick would."""
    clock = coord.approver.clock  # the clock the test injected; the loop reads it once per pass for the Tick
    coord.tick(Tick.of(t, vm, profile, False, pending,
                       now=clock.now(), monotonic=clock.monotonic()))
    assert coord.wait_idle(5)
    coord.absorb(clock.monotonic())


def test_leader_approves_once_when_everyone_is_ready(tmp_path, clock, peers):
    """vm1 (rank 0) waits for vm2 and vm3, then sends exactly one POST, recorded as sent."""
    coord, sent, store = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    answer(peers, "vm2", ready=True)
    answer(peers, "vm3", ready=False)
    step(coord, t, "vm1")
    step(coord, t, "vm1")
    assert sent == []
    assert "vm3" in coord.view("E1")["approval_decision"]
    peers.replace(responses.GET, f"{peer('vm3')}/v1/events/E1", json=view("vm3"))
    clock.advance(1)
    step(coord, t, "vm1")
    step(coord, t, "vm1")
    clock.advance(1)
    step(coord, t, "vm1")
    assert sent == [["E1"]]
    assert store.result("E1", "approval")["status"] == "sent"


def test_ready_peers_are_not_asked_again(tmp_path, clock, peers):
    """Ready is final: a ready peer is asked once, a not-ready one at most once per poll interval."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    answer(peers, "vm2", ready=True)
    answer(peers, "vm3", ready=False)
    for _ in range(3):
        step(coord, t, "vm1", pending=lambda t: ["checkpoint"])
    calls = [c.request.url for c in peers.calls]
    assert calls.count(f"{peer('vm2')}/v1/events/E1") == 1
    assert calls.count(f"{peer('vm3')}/v1/events/E1") == 1
    clock.advance(1.0)
    step(coord, t, "vm1", pending=lambda t: ["checkpoint"])
    assert [c.request.url for c in peers.calls].count(f"{peer('vm3')}/v1/events/E1") == 2


def test_non_leader_never_approves_while_the_leader_answers(tmp_path, clock, peers):
    """vm2 (rank 1) leaves approval to a reachable vm1, however long it waits."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2"])
    answer(peers, "vm1", ready=False)
    for _ in range(5):
        clock.advance(30)
        step(coord, t, "vm2")
    assert sent == [] and "not the leader" in coord.view("E1")["approval_decision"]


def vm1_silent_for(seconds: int, tmp_path, clock, peers, **settings):
    """vm2's view of E1 over `seconds` (a tick every 10 s): vm1 silent from the start, vm3 ready."""
    coord, sent, _ = make_coordinator(tmp_path, clock, **settings)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    answer(peers, "vm1", status=0)
    answer(peers, "vm3", ready=True)
    for _ in range(seconds // 10):
        step(coord, t, "vm2")
        clock.advance(10)
    return coord, sent, t


def test_a_silent_leader_is_taken_over_but_its_readiness_is_never_assumed(tmp_path, clock, peers, logs):
    """S1: vm1 silent (down, wedged, partitioned): vm2 leads after takeover_after, but with
    unreachable_peers: wait it never POSTs without vm1's `ready`; it says so in the log and in health."""
    health = HealthStore(clock)
    coord, sent, _ = vm1_silent_for(200, tmp_path, clock, peers, health=health)
    assert sent == []
    assert "waiting for peers: vm1" in coord.view("E1")["approval_decision"]
    assert [e["peers"] for e in logs if e["event"] == "approval.leader_silent"] == [["vm1"]]
    [report] = [r for r in health.to_json()["HealthEvents"] if r["Property"] == "takeover/E1"]
    assert report["HealthState"] == "Warning" and "NotBefore" in report["Description"]
    step(coord, {}, "vm2")
    assert not [r for r in health.to_json()["HealthEvents"] if r["Property"] == "takeover/E1"]


def test_with_ignore_the_taker_approves_once_the_silent_leader_is_past_peer_timeout(tmp_path, clock, peers):
    """The explicit opt-out: unreachable_peers: ignore waives the silent leader after peer_timeout (120 s)."""
    coord, sent, t = vm1_silent_for(110, tmp_path, clock, peers, unreachable_peers="ignore", peer_timeout=120.0)
    assert sent == []
    clock.advance(11)
    step(coord, t, "vm2")
    step(coord, t, "vm2")
    assert sent == [["E1"]]


def test_unreachable_peer_blocks_with_wait_and_is_ignored_after_peer_timeout(tmp_path, clock, peers):
    """unreachable_peers: wait never approves for a dead peer; ignore does after peer_timeout."""
    for policy, expected in (("wait", []), ("ignore", [["E1"]])):
        coord, sent, _ = make_coordinator(tmp_path / policy, clock, unreachable_peers=policy, peer_timeout=120.0)
        t = tracked(clock, ["vm1", "vm2"])
        answer(peers, "vm2", status=0)
        for _ in range(4):
            step(coord, t, "vm1")
            clock.advance(50)
        step(coord, t, "vm1")
        assert sent == expected, policy


def test_never_and_started_and_other_vms_events_are_not_approved(tmp_path, clock, peers):
    """No POST inside a `never` profile, for a Started event, or for an event not naming this VM."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    step(coord, tracked(clock, ["vm1"]), "vm1", profile=Profile(name="freeze", approval="never"))
    step(coord, tracked(clock, ["vm1"], status="Started", eid="E2"), "vm1")
    step(coord, tracked(clock, ["vm9"], eid="E3"), "vm1")
    assert sent == []


def test_a_sent_approval_is_never_sent_again_after_restart(tmp_path, clock, peers):
    """The state store remembers `sent`: a new coordinator over it sends nothing."""
    coord, sent, store = make_coordinator(tmp_path, clock)
    step(coord, tracked(clock, ["vm1"]), "vm1")
    step(coord, tracked(clock, ["vm1"]), "vm1")
    assert sent == [["E1"]]
    store2 = Store(tmp_path, clock)
    store2.load()
    sent2: list = []
    coord2 = Coordinator(coord.settings, approve=sent2.append, store=store2, clock=clock, metrics=Metrics())
    stopped_at_end(coord2)
    step(coord2, tracked(clock, ["vm1"]), "vm1")
    assert sent2 == []


def test_failed_posts_are_retried_with_backoff_then_recorded(tmp_path, clock):
    """A 500 from IMDS is retried (tenacity); when retries run out the failure is recorded and counted."""
    from agent.errors import ImdsUnavailable

    attempts: list[int] = []

    def flaky(ids):
        attempts.append(1)
        raise ImdsUnavailable("IMDS answered 500", 500)

    cfg = CoordinationConfig(approval_retry_for=10.0)
    store = Store(tmp_path, clock)
    metrics = Metrics()
    coord = Coordinator(cfg, approve=flaky, store=store, clock=clock, metrics=metrics)
    stopped_at_end(coord)
    step(coord, tracked(clock, ["vm1"]), "vm1")
    assert len(attempts) > 1
    assert store.result("E1", "approval")["status"] == "failed"
    assert sample(metrics, "maintd_approvals_total", outcome="failed") == 1


def test_a_ready_hint_makes_the_leader_ask_again_at_once_and_approve_without_waiting_a_poll(tmp_path, clock, peers):
    """vm3 says it is ready: vm1 re-asks it in the same poll interval (checking, not trusting) and approves."""
    changes: list[int] = []
    coord, sent, _ = make_coordinator(tmp_path, clock)
    coord.on_change = lambda: changes.append(1)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    answer(peers, "vm2", ready=True)
    answer(peers, "vm3", ready=False)
    step(coord, t, "vm1")
    assert not coord.hint("E1", "vm2"), "a peer already known ready needs no second look"
    peers.replace(responses.GET, f"{peer('vm3')}/v1/events/E1", json=view("vm3"))
    assert coord.hint("E1", "VM3")
    step(coord, t, "vm1")  # no clock advance: still inside the same poll interval
    step(coord, t, "vm1")
    assert sent == [["E1"]]
    assert len(changes) >= 2, "the hint and the peer turning ready each wake the loop"


def test_a_ready_follower_pushes_to_the_leader_until_it_takes_it_and_then_never_again(tmp_path, clock, peers):
    """vm2 (rank 1) pushes its readiness once it is ready, retries a failed push later, stops after success."""
    coord, _, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    answer(peers, "vm1", ready=False)
    push = f"{peer('vm1')}/v1/events/E1/peer-ready"
    peers.add(responses.POST, push, status=503)
    step(coord, t, "vm2", pending=lambda t: ["checkpoint"])
    assert not [c for c in peers.calls if c.request.method == "POST"], "no push while still preparing"
    step(coord, t, "vm2")
    peers.replace(responses.POST, push, json={"asked_again": True}, status=202)
    for _ in range(10):
        clock.advance(1)
        step(coord, t, "vm2")
    posts = [c for c in peers.calls if c.request.method == "POST"]
    assert [c.response.status_code for c in posts] == [503, 202]
    assert json.loads(posts[-1].request.body) == {"vm": "vm2"}
    assert coord.view("E1")["readiness_pushed_to"] == "vm1"


def test_many_events_ask_a_peer_one_request_at_a_time_and_peers_in_parallel(tmp_path, clock, peers):
    """Twenty events naming the same two peers: each peer gets one request at a time, no more
    threads ask than there are peers (not events x peers), and a slow peer does not delay the other."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    threads: dict[str, set[str]] = {"vm2": set(), "vm3": set()}
    active = {"vm2": 0, "vm3": 0}
    most = {"vm2": 0, "vm3": 0}
    vm3_asked = threading.Event()
    lock = threading.Lock()

    def handler(name):
        def reply(request):
            with lock:
                threads[name].add(threading.current_thread().name)
                active[name] += 1
                most[name] = max(most[name], active[name])
            if name == "vm3":
                vm3_asked.set()
            else:
                assert vm3_asked.wait(5), "vm3 was not asked while vm2 was busy"
            with lock:
                active[name] -= 1
            return 200, {}, json.dumps(view(name))
        return reply

    events = {}
    for i in range(20):
        events.update(tracked(clock, ["vm1", "vm2", "vm3"], eid=f"E{i}"))
        for name in ("vm2", "vm3"):
            peers.add_callback("GET", f"{peer(name)}/v1/events/E{i}", callback=handler(name))
    step(coord, events, "vm1")
    assert most == {"vm2": 1, "vm3": 1}
    assert len(threads["vm2"] | threads["vm3"]) <= 2, "more asking threads than peers"
    step(coord, events, "vm1")
    assert sorted(eid for batch in sent for eid in batch) == sorted(events)


def test_coordination_rules_cadence_and_chain():
    """The pure rules: backoff doubles to the cap, the chain stops at the first answering peer, pushes repeat."""
    assert [recheck_delay(n, 1.0, 10.0) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert liveness_interval(1.0, 60.0) == 5.0 and liveness_interval(1.0, 2.0) == 1.0
    down = PeerState(failing_since=0.0)
    assert watch_chain(["a", "b", "c"], {"a": down}) == ["a", "b"]
    assert acting_leader(["a", "b"], {"a": down, "b": down}) is None
    assert push_due("a", None, None, float("-inf"), 0.0, 5.0)
    assert not push_due("a", None, "a", 0.0, 1.0, 5.0) and push_due("a", None, "a", 0.0, 5.0, 5.0)
    assert not push_due("a", "a", "a", 0.0, 99.0, 5.0) and push_due("b", "a", "a", 0.0, 1.0, 5.0)


def test_s1_rule_needs_a_current_ready_from_every_vm_named_lower_ranked_included():
    """The pure S1 rule the model checker calls: a taker needs vm1's ready as much as vm3's; a lower-ranked
    peer's ready counts only while it answers; `ignore` waives any peer silent for peer_timeout."""
    from agent.coordination.coordination_rules import may_post, readiness_missing, silent_leaders
    silent_ready = PeerState(ready=True, last_ok=0.0, failing_since=10.0)
    ready = PeerState(ready=True, last_ok=99.0)
    rules = {"takeover_after": 60.0, "peer_timeout": 120.0}
    for peers, wait_ok, ignore_ok in (
            ({"vm1": PeerState(failing_since=0.0), "vm3": ready}, False, True),
            ({"vm1": silent_ready, "vm3": ready}, False, True),
            ({"vm1": silent_ready, "vm3": PeerState(failing_since=0.0)}, False, True),
            ({"vm1": silent_ready, "vm3": PeerState(last_ok=99.0)}, False, False)):
        assert may_post(["vm1"], ["vm3"], peers, 200.0, unreachable_peers="wait", **rules) is wait_ok
        assert may_post(["vm1"], ["vm3"], peers, 200.0, unreachable_peers="ignore", **rules) is ignore_ok
    assert readiness_missing(["vm1"], ["vm3"], {"vm1": silent_ready, "vm3": ready}, 100.0, "wait", 120.0) == ["vm1"]
    assert silent_leaders(["vm1"], {"vm1": silent_ready}, 100.0, 60.0, "wait", 120.0) == ["vm1"]
    assert silent_leaders(["vm1"], {"vm1": silent_ready}, 50.0, 60.0, "wait", 120.0) == []
    assert may_post([], ["vm2"], {"vm2": ready}, 0.0, unreachable_peers="wait", **rules)
