"""The blob coordination protocol's pure rules: layout, parsing that refuses what the protocol did not write,
decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from agent.coordination.store.store_protocol import (
    APPROVED,
    CLAIMED,
    PREPARING,
    READY,
    RELEASED,
    UNREADABLE,
    Item,
    approval_blob,
    approval_record,
    event_folder,
    fleet_health,
    marker_blob,
    marker_record,
    next_step,
    not_ready,
    parse_listing,
    post_deadline,
    recheck_delay,
    retry_delay,
    takeover_check_delay,
    unstorable,
    vm_state,
)

EVENT = "5F1E2B0C-9A4D-4C61-8E2F-1A2B3C4D5E6F"
VMS = ("web_3f2a9c1b", "Web_7c0d11e4", "web_90ab12cd")
NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=UTC)


def marker(vm: str, state: str = READY, age: float = 1.0, name: str | None = None, **extra: str) -> Item:
    return Item(marker_blob(EVENT, name or vm), {**marker_record(EVENT, vm, state), **extra}, f"e-{vm}",
                NOW - timedelta(seconds=age))


def record(by: str, state: str = CLAIMED, attempt: int = 1, age: float = 1.0,
           garble: dict[str, str] | None = None) -> Item:
    return Item(approval_blob(EVENT), {**approval_record(EVENT, by, state, attempt), **(garble or {})}, "etag-1",
                NOW - timedelta(seconds=age))


def listing(*items: Item):
    return parse_listing(EVENT, items, NOW, VMS)


def test_layout_keeps_each_event_in_its_folder_and_names_case_insensitively() -> None:
    """Markers and the record live under the event's folder; a VM's marker is found whatever the case of its name."""
    assert marker_blob(EVENT, "Web_7C0D11E4") == marker_blob(EVENT.lower(), "web_7c0d11e4")
    assert marker_blob(EVENT, "a").startswith(event_folder(EVENT))
    assert approval_blob(EVENT).startswith(event_folder(EVENT))
    assert unstorable(EVENT, VMS) is None
    assert "GUID" in (unstorable("../x", VMS) or "")
    assert "web/../x" in (unstorable(EVENT, ("web/../x",)) or "")


def test_every_vm_ready_and_no_record_means_claim() -> None:
    """All named VMs recorded ready and nobody has claimed: this VM claims (create if absent)."""
    seen = listing(*(marker(v) for v in VMS))
    assert not_ready(seen, VMS) == []
    assert next_step(seen, VMS, VMS[0], 60).action == "claim"


def test_a_vm_preparing_or_not_seen_means_wait_and_is_named() -> None:
    """A VM still preparing, or without a marker, blocks the claim and is named in the reason."""
    seen = listing(marker(VMS[0]), marker(VMS[1], PREPARING))
    assert not_ready(seen, VMS) == [VMS[1], VMS[2]]
    step = next_step(seen, VMS, VMS[0], 60)
    assert step.action == "wait" and VMS[1] in step.reason and VMS[2] in step.reason
    assert [vm_state(seen, v) for v in VMS] == [READY, PREPARING, "not seen"]


def test_immediate_claims_without_waiting_for_markers() -> None:
    """`immediate` by policy claims whatever the markers say (the claim still makes it one POST)."""
    assert next_step(listing(), VMS, VMS[0], 60, need_all_ready=False).action == "claim"


@pytest.mark.parametrize("bad, why", [
    (lambda: marker(VMS[0], name=VMS[1]), "names VM"),
    (lambda: marker(VMS[1], extra="1"), "unknown field extra"),
    (lambda: marker(VMS[1], state="done"), "unknown state"),
    (lambda: marker(VMS[1], health="fine"), "unknown health"),
    (lambda: marker(VMS[1], maintd="2"), "protocol version"),
    (lambda: marker(VMS[1], event="0000"), "not this event"),
    (lambda: Item(marker_blob(EVENT, VMS[1]), {"maintd": "1"}, "e", NOW), "missing"),
])
def test_a_marker_the_protocol_did_not_write_never_counts_as_ready(bad, why: str) -> None:
    """Another VM's name, an unknown field, an unknown state, another version or event: a problem, not ready."""
    seen = listing(marker(VMS[0]), bad(), marker(VMS[2]))
    assert VMS[1] in not_ready(seen, VMS)
    assert any(why in p for p in seen.problems), seen.problems
    assert next_step(seen, VMS, VMS[0], 60).action == "wait"


def test_a_blob_outside_the_layout_is_reported_and_ignored() -> None:
    """A stray blob in the folder (or a marker of a VM the event does not name) changes nothing but is reported."""
    stray = Item(event_folder(EVENT) + "vm/intruder", marker_record(EVENT, "intruder", READY), "e", NOW)
    seen = listing(*(marker(v) for v in VMS), stray)
    assert next_step(seen, VMS, VMS[0], 60).action == "claim"
    assert len(seen.problems) == 1 and "intruder" in seen.problems[0]


@pytest.mark.parametrize("garble", [
    {"state": "approvedd"}, {"attempt": "x"}, {"attempt": "0"}, {"by": "someone_else"}, {"kind": "vm"}, {"note": "hi"},
])
def test_a_garbled_approval_record_is_never_an_approval(garble: dict[str, str]) -> None:
    """An approval record the protocol did not write is unreadable: a claim by nobody, taken over once old, never
    'approved'."""
    items = [*(marker(v) for v in VMS), record(VMS[0], APPROVED, age=5, garble=garble)]
    seen = listing(*items)
    assert seen.approval is not None and seen.approval.state == UNREADABLE
    assert seen.problems and seen.problems[0].startswith("approval record")
    assert next_step(seen, VMS, VMS[1], 60).action == "wait"
    old = listing(*items[:-1], record(VMS[0], APPROVED, age=61, garble=garble))
    step = next_step(old, VMS, VMS[1], 60)
    assert step.action == "take_over" and step.etag == "etag-1"


def test_an_approved_record_settles_the_event() -> None:
    """Once the record says approved, nobody claims again, whatever its age."""
    seen = listing(*(marker(v) for v in VMS), record(VMS[2], APPROVED, age=3600))
    step = next_step(seen, VMS, VMS[0], 60)
    assert step.action == "done" and VMS[2] in step.reason


def test_a_fresh_claim_waits_and_a_stale_one_is_taken_over_on_the_store_clock() -> None:
    """Another VM's claim younger than takeover_after (server Date - Last-Modified) waits; older is taken over with
    If-Match on its ETag and the next attempt number."""
    ready = [marker(v) for v in VMS]
    young = next_step(listing(*ready, record(VMS[0], age=59)), VMS, VMS[1], 60)
    assert young.action == "wait" and VMS[0] in young.reason
    old = next_step(listing(*ready, record(VMS[0], attempt=3, age=60)), VMS, VMS[1], 60)
    assert (old.action, old.etag, old.attempt) == ("take_over", "etag-1", 4)


def test_a_released_claim_or_this_vms_own_claim_is_taken_over_at_once() -> None:
    """A claim released after a failed POST, or this VM's own claim from before a restart, is rewritten at once."""
    ready = [marker(v) for v in VMS]
    assert next_step(listing(*ready, record(VMS[0], RELEASED)), VMS, VMS[1], 60).action == "take_over"
    own = next_step(listing(*ready, record(VMS[1].upper())), VMS, VMS[1], 60)
    assert own.action == "take_over" and "own" in own.reason


def test_ages_never_go_negative_when_the_store_clock_lags_last_modified() -> None:
    """A Last-Modified after the listing's Date (clock skew inside the store) is age 0, not a negative age."""
    seen = listing(*(marker(v) for v in VMS), record(VMS[0], age=-30))
    assert seen.approval is not None and seen.approval.age == 0.0


def test_the_claimer_stops_posting_before_anyone_may_take_over() -> None:
    """The claimer's POST deadline is half of takeover_after, so a slow claimer and its taker never both post."""
    assert post_deadline(60) == 30 and post_deadline(60) < 60


def test_background_lists_back_off_and_bound_the_fleet_rate() -> None:
    """A VM relists from a quarter of its cap (at least 2 s) doubling to the cap, vms/5 s within [10 s, 60 s]: a
    fleet lists at most ~5/s, and a large one starts slow (15 s at 1000 VMs)."""
    assert [recheck_delay(n, 5) for n in (1, 2, 3, 4, 5)] == [2.5, 5, 10, 10, 10]
    assert [recheck_delay(n, 1000) for n in (1, 2, 3, 4)] == [15, 30, 60, 60]
    assert recheck_delay(20, 100) == 20 and recheck_delay(20, 500) == 60
    assert 100 / recheck_delay(20, 100) <= 5
    assert [retry_delay(n) for n in (1, 2, 3, 6, 50)] == [1, 2, 4, 30, 30]


def test_a_claim_is_rechecked_right_when_it_may_be_taken_over_spread_over_the_fleet() -> None:
    """A VM waiting on another's claim lists again when the claim turns takeover_after old (store time), plus a
    jitter of at most N/5 s (10 s cap); never for an approved record or its own claim."""
    ready = [marker(v) for v in VMS]
    claimed = listing(*ready, record(VMS[0], age=20))
    assert takeover_check_delay(claimed, VMS[1], 60, 3, 0.0) == 40
    assert takeover_check_delay(claimed, VMS[1], 60, 500, 0.99) == pytest.approx(40 + 9.9)
    assert takeover_check_delay(claimed, VMS[0], 60, 3, 0.0) is None
    assert takeover_check_delay(listing(*ready, record(VMS[0], APPROVED)), VMS[1], 60, 3, 0.0) is None
    assert takeover_check_delay(listing(*ready), VMS[1], 60, 3, 0.0) is None


def test_the_fleet_gate_reads_each_vms_health_from_its_marker() -> None:
    """ok / unhealthy as each VM recorded it; a VM without a readable marker is unreachable to the gate."""
    seen = listing(marker(VMS[0]), marker(VMS[1], health="unhealthy"))
    assert fleet_health(seen, VMS) == {VMS[0]: "ok", VMS[1]: "unhealthy", VMS[2]: "unreachable"}
