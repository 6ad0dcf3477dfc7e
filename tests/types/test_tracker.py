"""Diffing documents into transitions: appeared, status_changed, vanished (completed or canceled)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model.events import Document, Event, Skipped
from agent.model.tracker import APPEARED, CANCELED, COMPLETED, STATUS_CHANGED, VANISHED, diff

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def ev(eid: str, status: str = "Scheduled", resources=("vm1",), not_before=T0 + timedelta(minutes=15)) -> Event:
    return Event(event_id=eid, event_type="Reboot", status=status, resources=tuple(resources),
                 not_before=not_before if status == "Scheduled" else None)


def doc(*events: Event, incarnation: int = 1, skipped=()) -> Document:
    return Document(incarnation, tuple(events), tuple(skipped))


def step(prev, d, now=T0, boot="boot-a", vm="vm1"):
    return diff(prev, d, vm_name=vm, boot_id=boot, now=now)


def test_new_event_appears_once_with_its_scope():
    """The first document with an event yields one `appeared`; the same document again yields nothing."""
    tracked, trs = step({}, doc(ev("A"), ev("B", resources=("vm10",))))
    assert [(t.kind, t.event.event_id, t.names_self) for t in trs] == [(APPEARED, "A", True), (APPEARED, "B", False)]
    _, again = step(tracked, doc(ev("A"), ev("B", resources=("vm10",)), incarnation=2))
    assert again == []


def test_scheduled_to_started_is_a_status_change():
    """Scheduled → Started is reported with the previous status."""
    tracked, _ = step({}, doc(ev("A")))
    _, trs = step(tracked, doc(ev("A", "Started"), incarnation=3))
    assert [(t.kind, t.previous_status, t.event.status) for t in trs] == [(STATUS_CHANGED, "Scheduled", "Started")]


def test_started_then_gone_is_completed():
    """An event seen Started that leaves the document completed."""
    tracked, _ = step({}, doc(ev("A")))
    tracked, _ = step(tracked, doc(ev("A", "Started")))
    _, trs = step(tracked, doc())
    assert [(t.kind, t.outcome) for t in trs] == [(VANISHED, COMPLETED)]


def test_scheduled_then_gone_before_not_before_is_canceled():
    """Vanishing while still Scheduled, before NotBefore, without a reboot: canceled."""
    tracked, _ = step({}, doc(ev("A")))
    _, trs = step(tracked, doc(), now=T0 + timedelta(minutes=5))
    assert [(t.kind, t.outcome) for t in trs] == [(VANISHED, CANCELED)]


def test_scheduled_then_gone_after_a_reboot_is_completed():
    """The kernel boot id changed since the event was first seen: this VM rebooted, so it completed."""
    tracked, _ = step({}, doc(ev("A")), boot="boot-a")
    _, trs = step(tracked, doc(), now=T0 + timedelta(minutes=1), boot="boot-b")
    assert trs[0].outcome == COMPLETED


def test_scheduled_then_gone_after_not_before_is_completed():
    """A Started document shorter than a poll was missed: past NotBefore, the event happened."""
    tracked, _ = step({}, doc(ev("A")))
    _, trs = step(tracked, doc(), now=T0 + timedelta(minutes=16))
    assert trs[0].outcome == COMPLETED


def test_first_seen_already_started_appears_started_and_completes():
    """Hardware failure: an event born Started appears as Started, and its vanishing is completed."""
    tracked, trs = step({}, doc(ev("A", "Started")))
    assert [(t.kind, t.event.status) for t in trs] == [(APPEARED, "Started")]
    _, trs = step(tracked, doc())
    assert trs[0].outcome == COMPLETED


def test_incarnation_jumps_resets_and_reordering_change_nothing():
    """Documents are compared by content; incarnation gaps, resets and reordering are not transitions."""
    tracked, _ = step({}, doc(ev("A"), ev("B"), incarnation=5))
    for d in (doc(ev("B"), ev("A"), incarnation=9), doc(ev("A"), ev("B"), incarnation=1)):
        tracked, trs = step(tracked, d)
        assert trs == []


def test_an_unreadable_entry_with_a_known_id_does_not_vanish():
    """A garbled copy of a tracked event keeps it tracked: it must not look like finished maintenance."""
    tracked, _ = step({}, doc(ev("A")))
    tracked2, trs = step(tracked, doc(skipped=[Skipped(0, "EventType missing", "A")]))
    assert trs == [] and "A" in tracked2


def test_scope_uses_exact_names():
    """An event for vm10 does not name vm1."""
    _, trs = step({}, doc(ev("A", resources=("vm10", "VM1x"))))
    assert trs[0].names_self is False


ids = st.sampled_from(["A", "B", "C", "D"])
docs = st.lists(st.tuples(ids, st.sampled_from(["Scheduled", "Started"])), max_size=4, unique_by=lambda x: x[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(docs, min_size=1, max_size=8))
def test_transitions_are_consistent_over_any_sequence(sequence):
    """Over any sequence: each present id appears exactly once per presence, vanished ids are gone,
    and the tracked set always equals the latest document's ids."""
    tracked: dict = {}
    present: set[str] = set()
    for i, entries in enumerate(sequence):
        d = doc(*(ev(eid, status) for eid, status in entries), incarnation=i)
        tracked, trs = step(tracked, d, now=T0 + timedelta(seconds=i))
        ids_now = {eid for eid, _ in entries}
        appeared = {t.event.event_id for t in trs if t.kind == APPEARED}
        vanished = {t.event.event_id for t in trs if t.kind == VANISHED}
        assert appeared == ids_now - present
        assert vanished == present - ids_now
        assert set(tracked) == ids_now
        for t in trs:
            if t.kind == VANISHED:
                assert t.outcome in (COMPLETED, CANCELED)
        present = ids_now
