"""B5, the places record is data, not instructions: a holder "renewed" in 2099 blocks nobody and is reported; names
forged into `members` (or left by a scale-in) do not raise a percentage; a record that is no places record is a
counted problem too (an in-memory store with conditional writes, one fake clock)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from agent.clock import FakeClock
from agent.fleet.budget_rules import CHOSEN, Entry, Places, places_blob, render_places
from tests.budget_fakes import CasStore, member, want
from tests.fleet.test_budget import settle

BLOB = places_blob("web")


def forge(store: CasStore, places: Places) -> None:
    store.n += 1
    store.blobs[BLOB] = (render_places("web", places), f"forged{store.n}")


def problems(budget, problem: str) -> float:  # type: ignore[no-untyped-def]
    text = budget.metrics.render().decode()
    series = f'maintd_budget_record_problems_total{{problem="{problem}"}}'
    line = next(x for x in text.splitlines() if x.startswith(series))
    return float(line.split()[-1])


def test_a_holder_renewed_in_2099_blocks_nobody_and_is_counted_reported_and_dropped(logs) -> None:  # type: ignore[no-untyped-def]
    """The record says `ghost` holds the only place, renewed in 2099: the member takes the place at once (a
    holder in the future never came from the store's clock), each odd record is counted once however often it is
    read, Warning coordination/budget_records names it, one budget.invalid_record line, and the member's write
    leaves it out of the record."""
    clock = FakeClock()
    store = CasStore(clock)
    y2099 = datetime(2099, 1, 1, tzinfo=UTC)
    forge(store, Places((Entry("ghost", "1", "0", "e-ghost", CHOSEN, y2099, y2099),), (), {"ghost": y2099}))
    a, health = member(store, clock, "a")
    nb = clock.now() + timedelta(hours=1)
    gates = settle([a], {"a": [want("ea", nb)]}, {})
    assert gates["a"].allowed == {"ea"}
    assert [h["vm"] for h in a.publish()["holders"]] == ["a"]
    assert b"ghost" not in store.blobs[BLOB][0]
    settle([a], {"a": [want("ea", nb)]}, {})  # read again: the same odd records are not counted again
    assert problems(a, "future_instant") == 2  # its holder entry and its member stamp
    assert health.reports["budget_records"][0] == "warning" and "ghost" in health.reports["budget_records"][1]
    assert len([e for e in logs if e["event"] == "budget.invalid_record"]) == 1
    forge(store, Places((Entry("a", "1", "0", "ea", CHOSEN, clock.now(), clock.now()),), (), {"a": clock.now()}))
    clock.advance(3600)  # an hour of records as the protocol writes them: the Warning clears
    settle([a], {"a": [want("ea", nb)]}, {"a": True})
    assert health.reports["budget_records"][0] == "ok"


def test_two_hundred_stale_member_names_do_not_raise_a_fifty_percent_cap() -> None:
    """200 names in `members`, last stamped two hours ago (forged, or the VMs of a scale-in): 3 live members with
    max_unavailable 50 % get 1 place between them (50 % of 3), not 3; names stamped in 2099 count for nothing
    either."""
    clock = FakeClock()
    store = CasStore(clock)
    old, y2099 = clock.now() - timedelta(hours=2), datetime(2099, 1, 1, tzinfo=UTC)
    forge(store, Places((), (), {**{f"gone{i:03d}": old for i in range(200)},
                                 **{f"forged{i:03d}": y2099 for i in range(50)}}))
    members = [member(store, clock, f"vm{i}", max_unavailable="50%")[0] for i in range(3)]
    nb = clock.now() + timedelta(hours=1)
    wants = {f"vm{i}": [want(f"e{i}", nb)] for i in range(3)}
    gates = settle(members, wants, {})
    assert sum(1 for g in gates.values() if g.allowed) == 1, gates
    view = members[0].publish()
    assert (view["places"], view["members_known"]) == (1, 3)
    assert b"gone" not in store.blobs[BLOB][0]  # every write drops the stale names


def test_an_idle_member_stays_counted_and_one_that_stopped_drops_out_after_member_ttl() -> None:
    """A member with nothing to do refreshes its stamp every member_ttl / 3, so it keeps counting towards a
    percentage; a member whose daemon stopped is no longer counted once member_ttl passed."""
    clock = FakeClock()
    store = CasStore(clock)
    idle = [member(store, clock, f"idle{i}", max_unavailable="50%", member_ttl=600)[0] for i in range(3)]
    gone, _ = member(store, clock, "gone", max_unavailable="50%", member_ttl=600)
    settle([*idle, gone], {}, {})
    for _ in range(12):  # 20 minutes: twice member_ttl, `gone` no longer ticking
        clock.advance(100)
        settle(idle, {}, {})
    view = idle[0].publish()
    assert view["members_known"] == 3, view
    assert view["places"] == 1


def test_a_record_that_is_no_places_record_is_a_counted_problem_with_a_warning() -> None:
    """Not JSON at all: no place is taken on it (the member waits), the problem is counted and a Warning says
    so."""
    clock = FakeClock()
    store = CasStore(clock)
    store.blobs[BLOB] = (b"<html>not a record</html>", "x1")
    a, health = member(store, clock, "a")
    gates = settle([a], {"a": [want("ea", clock.now() + timedelta(hours=1))]}, {})
    assert not gates["a"].allowed
    assert problems(a, "unreadable") == 1
    assert health.reports["budget_records"][0] == "warning" and "not JSON" in health.reports["budget_records"][1]
