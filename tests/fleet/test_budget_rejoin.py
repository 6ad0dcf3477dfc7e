"""B7: a member back in rotation keeps its place for rejoin_wait (default probe.lb_timeout), the load balancer's
time to send it traffic again, before the next member may leave; one that never left rotation gives it back at
once. An in-memory store with conditional writes, one fake clock."""

from __future__ import annotations

from datetime import timedelta

from agent.clock import FakeClock
from agent.config.config import loads
from agent.fleet.budget import Budget
from agent.loop.fleet_pass import rejoin_seconds
from tests.budget_fakes import CasStore, Health, Hints, member, want
from tests.fleet.test_budget import settle

REJOIN = 11.0


Member = tuple[Budget, Health]


def two(rejoin: float = REJOIN) -> tuple[FakeClock, CasStore, Hints, Member, Member, dict]:
    """One place: `a` holds it, `b` waits (hints delivered, so `b` is told the moment a place is its own)."""
    clock = FakeClock()
    store = CasStore(clock)
    hints = Hints()
    nb = clock.now() + timedelta(hours=1)
    a, b = (member(store, clock, n, hints=hints, rejoin=rejoin) for n in "ab")
    wants = {n: [want(f"e{n}", nb)] for n in "ab"}
    settle([a[0]], wants, {})
    settle([b[0]], wants, {})
    assert a[0].mine.why == "chosen" and b[0].mine.why is None
    return clock, store, hints, a, b, wants


def leaves_only_after_rejoin(clock: FakeClock, budgets: list[Budget], wants: dict) -> None:
    """The member back in rotation (`budgets[0]`, now) keeps its place: `b` (the last) may not leave a second
    before rejoin_wait has passed, and leaves once it has."""
    clock.advance(REJOIN - 1)
    assert not settle(budgets, wants, {})["b"].allowed
    clock.advance(1)
    assert settle(budgets, wants, {})["b"].allowed == {"eb"}


def test_a_member_back_in_rotation_keeps_its_place_for_rejoin_wait_then_the_next_one_leaves() -> None:
    clock, _, _, (a, health), (b, _), wants = two()
    wants.pop("a")
    settle([a, b], wants, {"a": True})  # prepared and out of rotation
    settle([a, b], wants, {})  # back in rotation: the load balancer has not sent it traffic yet
    assert a.deadline() == clock.monotonic() + REJOIN  # the loop wakes to give the place back on time
    assert "keeps its place" in health.reports["budget"][1]
    clock.advance(REJOIN - 0.5)
    gates = settle([a, b], wants, {})
    assert not gates["b"].allowed and [h["vm"] for h in a.publish()["holders"]] == ["a"]
    clock.advance(0.5)
    assert settle([a, b], wants, {})["b"].allowed == {"eb"}
    assert a.mine.why is None


def test_a_member_seated_that_never_left_rotation_gives_its_place_back_at_once() -> None:
    """Its event went away before it left rotation: nothing for the load balancer to take back."""
    _, _, _, (a, _), (b, _), wants = two()
    wants.pop("a")
    assert settle([a, b], wants, {})["b"].allowed == {"eb"}


def test_a_forced_member_back_in_rotation_still_counts_for_rejoin_wait() -> None:
    """B3 and B7: a member out over budget counts while it is out and for rejoin_wait after."""
    clock = FakeClock()
    store = CasStore(clock)
    hints = Hints()
    soon = clock.now() + timedelta(seconds=30)  # inside the 60 s its preparation needs: forced at once
    later = clock.now() + timedelta(hours=1)
    (a, _), (b, _) = (member(store, clock, n, hints=hints, rejoin=REJOIN) for n in "ab")
    wants = {"a": [want("ea", soon)], "b": [want("eb", later)]}
    settle([a, b], wants, {})
    assert a.mine.forced and not settle([b], wants, {})["b"].allowed
    wants.pop("a")
    settle([a, b], wants, {"a": True})
    settle([a, b], wants, {})
    leaves_only_after_rejoin(clock, [a, b], wants)


def test_a_restart_that_finds_its_place_held_keeps_it_for_rejoin_wait_from_its_start() -> None:
    """kill -9 while back in rotation (or while out): the new process cannot know how long ago it came back, so it
    keeps the place the whole rejoin_wait from its start."""
    clock, store, hints, (a, _), (b, _), wants = two()
    wants.pop("a")
    settle([a, b], wants, {"a": True})
    a.stop()  # killed while out; it comes back up in rotation
    again, _ = member(store, clock, "a", hints=hints, rejoin=REJOIN)
    settle([again, b], wants, {})
    leaves_only_after_rejoin(clock, [again, b], wants)


def test_rejoin_wait_is_the_load_balancers_timeout_unless_set() -> None:
    base = "coordination: {backend: azure_blob, azure_blob: {account_url: 'https://a.blob.core.windows.net'}, "
    probe = "probe: {lb_timeout: 20s, lb_interval: 10s}\n"
    assert rejoin_seconds(loads(base + "budget: {group: web}}\n" + probe)) == 20.0
    assert rejoin_seconds(loads(base + "budget: {group: web, rejoin_wait: 0s}}\n" + probe)) == 0.0
    assert rejoin_seconds(loads(base + "budget: {group: web, rejoin_wait: 3s}}\n" + probe)) == 3.0
