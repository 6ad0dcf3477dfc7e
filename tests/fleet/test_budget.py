"""The disruption budget as VMs take part in it (an in-memory store with conditional writes, one fake clock):
at most max_unavailable out by choice, the next one goes when a place frees, the store down means wait and
prepare at the last safe moment, a member that never came back frees its place after release_after."""

from __future__ import annotations

from datetime import timedelta

import pytest

from agent.clock import FakeClock
from agent.fleet.budget import Budget
from agent.model.budget_gate import LeaveGate
from tests.budget_fakes import CasStore, Hints, member, want


def settle(budgets: list[Budget], wants: dict[str, list], out: dict[str, bool]) -> dict[str, LeaveGate]:
    """Tick every member until the store has answered every step (each worker step handed back)."""
    gates: dict[str, LeaveGate] = {}
    for _ in range(6):
        for b in budgets:
            gates[b._name()] = b.tick(wants.get(b._name(), []), out.get(b._name(), False))
            b.wait_idle(5)
    return gates


def test_four_members_one_place_never_two_out_and_the_next_goes_once_one_is_back() -> None:
    """The next in line goes at once when one is back (the release hands it the place and wakes it), with no
    time passing for a poll."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(minutes=10)
    hints = Hints()
    budgets = [member(store, clock, f"vm{i}", hints=hints)[0] for i in range(4)]
    wants = {f"vm{i}": [want(f"e{i}", nb)] for i in range(4)}
    order = []
    for _ in range(4):
        gates = settle(budgets, wants, {})
        out = [n for n, g in gates.items() if g.allowed]
        assert len(out) == 1, gates
        order.append(out[0])
        wants.pop(out[0])  # prepared: no longer held, out of rotation until its event ends
        settle(budgets, wants, {out[0]: True})
        settle(budgets, wants, {})  # back in rotation: released
        clock.advance(5)
    assert sorted(order) == ["vm0", "vm1", "vm2", "vm3"]
    assert all(b.reason_for(f"e{i}") == "chosen" for i, b in enumerate(budgets))


def test_the_store_down_no_member_leaves_early_and_each_prepares_at_its_last_safe_moment() -> None:
    clock = FakeClock()
    store = CasStore(clock)
    store.down = True
    nb = clock.now() + timedelta(minutes=10)
    b, health = member(store, clock, "vm0", needs=120)
    wants = {"vm0": [want("e0", nb)]}
    assert not settle([b], wants, {})["vm0"].allowed
    assert health.reports["budget"][0] == "warning" and "fake store" in health.reports["budget"][1]
    clock.advance(10 * 60 - 126)
    assert not settle([b], wants, {})["vm0"].allowed
    clock.advance(1)
    assert settle([b], wants, {})["vm0"].allowed == {"e0"}
    assert b.reason_for("e0") == "forced"


def test_preempt_is_forced_at_once_and_counts_as_out_for_the_others() -> None:
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(minutes=10)
    a, _ = member(store, clock, "vm0")
    c, _ = member(store, clock, "vm1")
    gates = settle([a], {"vm0": [want("e0", nb, "Preempt")]}, {})
    assert gates["vm0"].allowed == {"e0"}
    assert not settle([c], {"vm1": [want("e1", nb)]}, {})["vm1"].allowed
    assert c.publish()["holders"][0]["why"] == "forced"


def test_spread_zone_never_two_zones_out() -> None:
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(minutes=10)
    a, _ = member(store, clock, "a", zone="1", max_unavailable=3, spread="zone")
    b, _ = member(store, clock, "b", zone="2", max_unavailable=3, spread="zone")
    c, _ = member(store, clock, "c", zone="1", max_unavailable=3, spread="zone")
    gates = settle([a, b, c], {"a": [want("ea", nb)], "b": [want("eb", nb)], "c": [want("ec", nb)]}, {})
    zones = {n for n, g in gates.items() if g.allowed}
    assert zones in ({"a", "c"}, {"b"})


def test_a_member_that_never_comes_back_frees_its_place_after_release_after() -> None:
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=2)
    gone, _ = member(store, clock, "gone", release_after=600)
    assert settle([gone], {"gone": [want("e0", nb)]}, {})["gone"].allowed
    gone.stop()  # killed while out: it renews no more
    other, _ = member(store, clock, "other", release_after=600)
    assert not settle([other], {"other": [want("e1", nb)]}, {})["other"].allowed
    clock.advance(601)
    assert settle([other], {"other": [want("e1", nb)]}, {})["other"].allowed == {"e1"}


def test_a_multi_vm_event_approves_early_only_when_every_member_holds_a_place_or_is_forced() -> None:
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(minutes=10)
    a, _ = member(store, clock, "a", needs=60)
    b, _ = member(store, clock, "b", needs=60)
    settle([a, b], {"a": [want("e", nb)], "b": [want("e", nb)]}, {})
    holder = a if a.mine.why else b
    assert holder.approval_blocked("e", ["a", "b"]) is not None
    clock.advance(10 * 60 - 65)  # the other's last safe moment
    settle([a, b], {"a": [want("e", nb)], "b": [want("e", nb)]}, {})
    settle([a, b], {}, {"a": True, "b": True})
    assert holder.approval_blocked("e", ["a", "b"]) is None


def line(names: str, hints: Hints | None = None) -> tuple[FakeClock, CasStore, list[Budget], dict]:
    """One place; each member of `names` in turn asks for it for its own event (NotBefore in an hour): the first
    holds it, the others wait in that order."""
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=1)
    budgets = [member(store, clock, n, hints=hints, fallback_poll=120)[0] for n in names]
    wants = {n: [want(f"e{n}", nb)] for n in names}
    for b in budgets:
        settle([b], wants, {})
    return clock, store, budgets, wants


def handed_over(hints: Hints | None, lost: bool = False) -> tuple[FakeClock, CasStore, Budget, Budget, dict]:
    """Two members, one place: `a` out, `b` waiting; `a` comes back (its release hands `b` the place)."""
    clock, store, (a, b), wants = line("ab", hints)
    assert a.mine.why is not None and b.mine.why is None
    wants.pop("a")
    if hints is not None:
        hints.lost = lost
    settle([a], wants, {"a": True})
    settle([a], wants, {})  # back in rotation: released, the place handed to b in the same write
    assert a.publish()["holders"] == [] or a.publish()["holders"][0]["vm"] == "b"
    return clock, store, a, b, wants


def test_a_release_hands_the_place_to_the_next_in_line_who_leaves_at_once_when_hinted() -> None:
    _, _, a, b, wants = handed_over(Hints())
    assert a.publish()["holders"][0]["vm"] == "b" and a.publish()["holders"][0]["why"] == "chosen"
    assert settle([b], wants, {})["b"].allowed == {"eb"}
    assert b.reason_for("eb") == "chosen"


def test_a_lost_hint_costs_at_most_a_second_for_the_member_next_in_line() -> None:
    """B4: the member first in line reads the record every second, so a lost hint costs at most that."""
    clock, _, a, b, wants = handed_over(Hints(), lost=True)
    assert not settle([b], wants, {})["b"].allowed  # nobody told it yet
    clock.advance(1)
    assert settle([b], wants, {})["b"].allowed == {"eb"}


def test_a_flood_of_wake_hints_costs_at_most_one_store_read_per_second() -> None:
    """A waiting member behind the head of the line (its own reads are 15 s apart) hinted 50 times in 5 s (a
    place is still held: hints that say nothing) reads the store at most once a second; a hint for another VM or of
    a bad shape wakes nothing and never crashes."""
    clock, store, (_, _, b), wants = line("abc")
    before = store.requests
    for _ in range(50):
        b.wake({"group": "web", "vm": "c"})
        settle([b], wants, {})
        clock.advance(0.1)
    assert 1 <= store.requests - before <= 6
    assert b.wake({"vm": "someone-else"}) == {"woken": False}
    for junk in ([], "x", {"vm": 3}, 7):
        with pytest.raises(ValueError):
            b.wake(junk)


def test_a_member_whose_event_went_away_while_it_waited_leaves_the_line_and_is_never_handed_a_place() -> None:
    _, _, (a, b, _), wants = line("abc")
    wants.pop("b")  # b's event was cancelled
    settle([b], wants, {})
    wants.pop("a")
    settle([a], wants, {})  # a is back: the place goes to c, not to b
    assert [(h["vm"], h["event_id"]) for h in a.publish()["holders"]] == [("c", "ec")]
    assert a.publish()["waiting"] == []
