"""The disruption budget's config and pure rules, as an operator would notice them: at most max_unavailable out
by choice, never two zones at once, a member that never came back frees its place, the last safe moment."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from agent.config.config import loads
from agent.errors import ConfigError
from agent.fleet.budget_lease import forced_reason, lease_end, lease_margin
from agent.fleet.budget_rules import (
    CHOSEN,
    FORCE_MARGIN,
    FORCED,
    RELEASE,
    RENEW,
    TAKE,
    Me,
    Places,
    apply_step,
    approval_blocked,
    blocked,
    capacity,
    counts,
    forced_now,
    last_safe_moment,
    live,
    parse_places,
    queue,
    release,
    render_places,
    take,
)

T0 = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)
STORE = """coordination:
  backend: {backend}
  azure_blob: {{account_url: "https://acct.blob.core.windows.net"}}
  budget:
{body}"""


def budget_config(body: str, backend: str = "azure_blob"):  # type: ignore[no-untyped-def]
    return loads(STORE.format(backend=backend, body=body)).coordination.budget


def test_the_issue_s_config_is_read_with_percent_and_durations() -> None:
    b = budget_config("    group: web\n    max_unavailable: 25%\n    spread: zone\n    release_after: 30m\n")
    assert (b.group, b.max_unavailable, b.spread, b.release_after) == ("web", "25%", "zone", 1800.0)
    assert budget_config("    max_unavailable: 2\n").max_unavailable == 2


def test_a_budget_with_the_peer_backend_is_refused_naming_the_key_and_the_reason() -> None:
    with pytest.raises(ConfigError) as err:
        budget_config("    group: web\n", backend="peers")
    assert "budget" in str(err.value) and "shared store" in str(err.value)


@pytest.mark.parametrize("value", ["0", "0%", "150%", "-1", "many", "true"])
def test_a_bad_max_unavailable_is_refused(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        budget_config(f"    max_unavailable: {value}\n")
    assert "max_unavailable" in str(err.value)


def test_percent_counts_the_members_known_to_the_store_and_is_at_least_one() -> None:
    assert [capacity("25%", n) for n in (0, 3, 4, 12, 200)] == [1, 1, 1, 3, 50]
    assert capacity(2, 1) == 2


def me(vm: str, zone: str = "1") -> Me:
    return Me(vm, zone, "0")


def test_one_place_one_holder_others_wait_first_come_first() -> None:
    places = take(Places(), me("a"), "e1", CHOSEN, T0)
    assert blocked(places, me("b"), 1, "none") is not None
    places = queue(queue(places, me("b"), "e2", T0), me("c"), "e3", T0 + timedelta(seconds=1))
    places = release(places, "a", T0 + timedelta(seconds=5))
    assert blocked(places, me("c"), 1, "none") is not None  # b waited longer
    assert blocked(places, me("b"), 1, "none") is None


def waiters(*members: tuple[str, str]) -> Places:
    """`a` (zone 1) holds the place; the members wait in this order, a second apart."""
    places = take(Places(), me("a", "1"), "ea", CHOSEN, T0)
    for i, (vm, zone) in enumerate(members):
        places = queue(places, me(vm, zone), f"e{vm}", T0 + timedelta(seconds=i + 1))
    return places


def test_a_release_hands_its_place_to_the_first_in_line_in_the_same_write() -> None:
    later = T0 + timedelta(minutes=5)
    result, _, places = apply_step(waiters(("b", "1"), ("c", "1")), RELEASE, me("a"), "ea", 1, "none", later)
    assert result == "released" and [(h.vm, h.why, h.since) for h in places.holders] == [("b", CHOSEN, later)]
    assert [w.vm for w in places.waiting] == ["c"]


def test_a_handoff_respects_the_count_forced_members_included() -> None:
    places = take(waiters(("b", "1"), ("c", "1"), ("d", "1")), me("f", "1"), "ef", FORCED, T0)
    _, _, after = apply_step(places, RELEASE, me("a"), "ea", 2, "none", T0)
    assert [h.vm for h in after.holders] == ["f", "b"] and [w.vm for w in after.waiting] == ["c", "d"]


def test_a_handoff_skips_a_waiter_whose_zone_would_break_the_spread_and_seats_the_next() -> None:
    places = take(waiters(("b", "2"), ("c", "1"), ("d", "1")), me("e", "1"), "ee", CHOSEN, T0)
    _, _, after = apply_step(places, RELEASE, me("a"), "ea", 3, "zone", T0)
    assert [h.vm for h in after.holders] == ["e", "c", "d"] and [w.vm for w in after.waiting] == ["b"]
    _, _, emptied = apply_step(apply_step(after, RELEASE, me("e"), "ee", 3, "zone", T0)[2], RELEASE, me("c"), "ec",
                               3, "zone", T0)
    _, _, last = apply_step(emptied, RELEASE, me("d"), "ed", 3, "zone", T0)
    assert [h.vm for h in last.holders] == ["b"]  # once zone 1 is all back, zone 2's waiter goes


def test_a_member_handed_a_place_confirms_it_with_its_own_write_and_a_stale_grant_is_freed() -> None:
    """B1: a member seated by another's write (the handoff) is out by choice only on a write of its own: its TAKE
    rewrites its entry, renewed at its own read (the old rule answered "acquired" without writing)."""
    _, _, places = apply_step(waiters(("b", "1")), RELEASE, me("a"), "ea", 1, "none", T0)
    later = T0 + timedelta(seconds=3)
    result, _, mine = apply_step(places, TAKE, me("b"), "eb", 1, "none", later, 450)
    assert result == "acquired" and mine != places
    held = mine.holder("b")
    assert held is not None and held.renewed == later and held.why == CHOSEN and held.since == T0
    assert live(places, T0 + timedelta(minutes=30), 1800).holder("b") is None


def test_renewing_an_entry_that_is_not_there_is_a_lost_place_never_renewed() -> None:
    """B2: a holder dropped by another member (it did not renew for release_after) finds its place lost."""
    held = take(Places(), me("a"), "e1", CHOSEN, T0)
    dropped = live(held, T0 + timedelta(seconds=1801), 1800)
    result, why, same = apply_step(dropped, RENEW, me("a"), "e1", 1, "none", T0 + timedelta(seconds=1801))
    assert result == "lost" and "no longer in the record" in why and same.holder("a") is None
    result, _, again = apply_step(held, RENEW, me("a"), "e1", 1, "none", T0 + timedelta(seconds=60))
    assert result == "renewed" and again.holder("a") is not None


def test_the_lease_ends_before_others_may_drop_the_entry_by_its_margin() -> None:
    """B2: on the member's own clock, the place ends release_after less 2 s + 1 % after it sent the read whose
    Date renewed its entry; an entry renewed earlier than that read leaves less."""
    assert lease_margin(1800) == pytest.approx(20.0) and lease_margin(12) == pytest.approx(2.12)
    assert lease_end(100.0, T0, T0, 1800) == pytest.approx(100 + 1800 - 20)
    assert lease_end(100.0, T0, T0 + timedelta(seconds=60), 1800) == pytest.approx(100 + 1800 - 60 - 20)


@pytest.mark.parametrize(("event_type", "not_before", "words"), [
    ("Preempt", T0, "Preempt: at once"), ("Terminate", T0, "Terminate: at once"),
    ("Reboot", None, "no NotBefore"), ("Reboot", T0, "no place by its last safe moment"),
    ("Redeploy", T0, "no place by its last safe moment")])
def test_the_forced_line_says_why_for_each_kind_of_event(event_type: str, not_before: datetime | None,
                                                         words: str) -> None:
    """Finding 7: a Reboot forced at its last safe moment no longer says "Preempt/Terminate: at once"."""
    assert words in forced_reason(event_type, not_before)


def test_forced_members_count_as_out_for_everyone_else() -> None:
    places = take(Places(), me("a"), "e1", FORCED, T0)
    assert blocked(places, me("b"), 1, "none") is not None
    assert counts(places) == {"out": 0, "forced": 1, "waiting": 0}


def test_spread_zone_never_two_zones_out_by_choice() -> None:
    places = take(Places(), me("a", "1"), "e1", CHOSEN, T0)
    assert "zone" in (blocked(places, me("b", "2"), 3, "zone") or "")
    assert blocked(places, me("c", "1"), 3, "zone") is None
    assert blocked(places, me("b", "2"), 3, "none") is None


def test_a_member_that_never_came_back_frees_its_place_after_release_after() -> None:
    places = take(Places(), me("a"), "e1", CHOSEN, T0)
    assert live(places, T0 + timedelta(minutes=29), 1800).holder("a") is not None
    assert live(places, T0 + timedelta(minutes=30), 1800).holder("a") is None


def test_the_record_survives_a_round_trip_and_any_junk_is_a_reason_not_a_crash() -> None:
    places = queue(take(Places(), me("a"), "e1", CHOSEN, T0), me("b"), "e2", T0)
    assert parse_places(render_places("web", places)) == places
    for junk in (b"", b"{", b"[]", b'{"maintd":1,"kind":"places"}', b'{"maintd":1,"kind":"places","holders":[1],'
                 b'"waiting":[],"members":{}}', b"\xff" * 10, b"[" * 100000):
        assert isinstance(parse_places(junk), str)


def test_last_safe_moment_is_notbefore_minus_the_longer_of_needs_and_lead_time() -> None:
    nb = T0 + timedelta(minutes=10)
    assert last_safe_moment(nb, 90, 0) == nb - timedelta(seconds=90 + FORCE_MARGIN)
    assert last_safe_moment(nb, 90, 300) == nb - timedelta(seconds=300 + FORCE_MARGIN)
    assert not forced_now("Reboot", nb, 90, 0, nb - timedelta(seconds=91 + FORCE_MARGIN))
    assert forced_now("Reboot", nb, 90, 0, nb - timedelta(seconds=90 + FORCE_MARGIN))
    assert forced_now("Preempt", nb, 90, 0, T0) and forced_now("Terminate", nb, 90, 0, T0)


def test_a_multi_vm_event_approves_early_only_when_every_member_holds_a_place_or_is_forced() -> None:
    places = take(Places(), me("a"), "e1", CHOSEN, T0)
    assert approval_blocked(["a", "b"], "e1", places, frozenset()) is not None
    assert approval_blocked(["a", "b"], "e1", take(places, me("b"), "e1", FORCED, T0), frozenset()) is None
    assert approval_blocked(["a"], "e2", places, frozenset()) is not None  # a holds for another event
    assert approval_blocked(["a"], "e1", None, frozenset({"a"})) is None


def test_maintd_fleet_shows_the_group_who_holds_a_place_since_when_why_and_who_waits() -> None:
    from agent.cli.cliviews import fleet_text
    body = {"vm_name": "a", "backend": "azure_blob", "events": [], "budget": {
        "group": "web", "places": 1, "max_unavailable": 1, "spread": "zone", "members_known": 3, "store_error": None,
        "holders": [{"vm": "a", "since": "2026-11-27T01:00:00Z", "why": "forced", "event_id": "e1"}],
        "waiting": [{"vm": "b", "since": "2026-11-27T01:00:05Z", "event_id": "e2"}]}}
    shown = fleet_text(body)
    assert "Budget web" in shown and "forced" in shown and "waits" in shown and "2026-11-27T01:00:00Z" in shown
