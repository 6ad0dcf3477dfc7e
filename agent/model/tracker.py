"""Diffing successive Scheduled Events documents into transitions (pure: no I/O, time is a parameter).

Documents are compared by content (EventId and EventStatus), never by DocumentIncarnation, which
has gaps (a Started document shorter than a poll) and resets (Scheduled Events re-enabled after
24 h idle). A vanished event carries an outcome:

- `completed`: it had been seen Started, this VM rebooted since it was first seen (the kernel
  boot id changed), or its NotBefore had passed — the maintenance happened;
- `canceled`: it vanished while still Scheduled, before its NotBefore, with no reboot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Mapping

from agent.model.events import Document, Event

APPEARED = "appeared"
STATUS_CHANGED = "status_changed"
VANISHED = "vanished"
COMPLETED = "completed"
CANCELED = "canceled"


@dataclass(frozen=True)
class Tracked:
    """What maintd remembers of an event it has seen (persisted in the state store)."""

    event: Event
    names_self: bool
    first_seen: datetime
    boot_id: str
    seen_started: bool


@dataclass(frozen=True)
class Transition:
    """One change in an event's life, as the handlers and the audit journal see it."""

    kind: str
    event: Event
    names_self: bool
    at: datetime
    previous_status: str | None = None
    outcome: str | None = None


def _vanish_outcome(t: Tracked, boot_id: str, now: datetime) -> str:
    if t.seen_started or t.event.status == "Started":
        return COMPLETED
    if t.names_self and boot_id and t.boot_id and boot_id != t.boot_id:
        return COMPLETED
    if t.event.not_before is not None and now >= t.event.not_before:
        return COMPLETED
    return CANCELED


def diff(
    previous: Mapping[str, Tracked],
    document: Document,
    *,
    vm_name: str,
    boot_id: str,
    now: datetime,
) -> tuple[dict[str, Tracked], list[Transition]]:
    """The tracked set after `document`, and the transitions that lead there from `previous`.

    An event the parser skipped but whose EventId it could read is kept as it was: a garbled
    entry must not look like a finished maintenance.
    """
    current: dict[str, Tracked] = {}
    transitions: list[Transition] = []
    for event in document.events:
        names_self = event.names(vm_name)
        before = previous.get(event.event_id)
        if before is None:
            current[event.event_id] = Tracked(event, names_self, now, boot_id, event.status == "Started")
            transitions.append(Transition(APPEARED, event, names_self, now))
            continue
        seen_started = before.seen_started or event.status == "Started"
        if before.event == event and before.seen_started == seen_started:
            current[event.event_id] = before  # the common case, every poll: nothing new about this event
        else:
            current[event.event_id] = replace(before, event=event, names_self=names_self, seen_started=seen_started)
        if event.status != before.event.status:
            transitions.append(Transition(STATUS_CHANGED, event, names_self, now, previous_status=before.event.status))
    unreadable = {s.event_id for s in document.skipped if s.event_id}
    for event_id, before in previous.items():
        if event_id in current:
            continue
        if event_id in unreadable:
            current[event_id] = before
            continue
        transitions.append(
            Transition(VANISHED, before.event, before.names_self, now, previous_status=before.event.status,
                       outcome=_vanish_outcome(before, boot_id, now))
        )
    return current, transitions
