"""Diffing successive Scheduled Events documents into transitions (pure: no I/O, time is a parameter).

Documents are compared by content (EventId and EventStatus), never by DocumentIncarnation, which
has gaps (a Started document shorter than a poll) and resets (Scheduled Events re-enabled after
24 h idle). A vanished event carries an outcome:

- `completed`: it had been seen Started, this VM rebooted since it was first seen (the kernel
  boot id changed), or its NotBefore had passed — the maintenance happened;
- `canceled`: it vanished while still Scheduled, before its NotBefore, with no reboot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Final, Literal

from agent.model.events import SCHEDULED, STARTED, Document, Event
from agent.model.outcomes import PHASE_COMPLETED, PHASE_SCHEDULED, PHASE_STARTED, Phase

TransitionKind = Literal["appeared", "status_changed", "vanished"]
"""What happened to an event between two documents."""
APPEARED: Final = "appeared"
STATUS_CHANGED: Final = "status_changed"
VANISHED: Final = "vanished"
VanishOutcome = Literal["completed", "canceled"]
"""How a vanished event ended: it had started (or was seen Started), or it was withdrawn before."""
COMPLETED: Final = "completed"
CANCELED: Final = "canceled"


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

    kind: TransitionKind
    event: Event
    names_self: bool
    at: datetime
    previous_status: str | None = None
    outcome: VanishOutcome | None = None


def phase_in(event: Event) -> Phase | None:
    """The handler phase a present event is in: `scheduled` while Scheduled, `started` once Started (what a
    restart resumes)."""
    return PHASE_SCHEDULED if event.status == SCHEDULED else PHASE_STARTED if event.status == STARTED else None


def phase_for(tr: Transition) -> Phase | None:
    """The handler phase a transition starts (None when there is none): `completed` when the event vanished,
    the phase it is in when it appeared or turned Started."""
    if tr.kind == VANISHED:
        return PHASE_COMPLETED
    if tr.kind == APPEARED or tr.event.status == STARTED:
        return phase_in(tr.event)
    return None


def _vanish_outcome(t: Tracked, boot_id: str, now: datetime) -> VanishOutcome:
    if t.seen_started or t.event.status == STARTED:
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
            current[event.event_id] = Tracked(event, names_self, now, boot_id, event.status == STARTED)
            transitions.append(Transition(APPEARED, event, names_self, now))
            continue
        seen_started = before.seen_started or event.status == STARTED
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
