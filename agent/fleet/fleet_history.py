"""The fleet history's store lane: this VM's outcome for an event written once, and the group's history read back.

The loop decides that an event has ended for this VM and hands an immutable `VmOutcome` to `write`;
the write runs on the `history` lane (one worker): it notes the attempt in the state store (on disk
before the request, so a VM killed -9 mid-request knows it tried), asks the store who approved when
this VM did not (one listing of the approval record), and creates the record with If-None-Match: *
(a second attempt, after a failure or a restart, finds it there: a 409, counted as `existed`). The
result goes back to the loop the way handler results do: recorded in the state store first (key
`history` of the event), which the loop reads. So a VM makes at most MAX_ATTEMPTS creates per event,
whatever happens. `read` runs on an API worker: one listing per day folder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from typing import Any, NotRequired, TypedDict

from agent.clock import Clock
from agent.coordination.store.store_exchange import Store
from agent.coordination.store.store_protocol import StoreError, approval_blob
from agent.fleet.history_protocol import (
    EventHistory,
    VmOutcome,
    day_folder,
    days,
    history_blob,
    history_view,
    parse_record,
    to_metadata,
    with_approval,
)
from agent.lanes import Lanes
from agent.model.fleet_records import EXISTED, FAILED, RECORDED, SENDING, HistoryStatus
from agent.model.timefmt import instant_or_none, iso_z
from agent.telemetry import logs

HistoryUnreadable = StoreError
"""What `FleetHistory.read` raises when the store cannot answer (the API answers 503)."""

HISTORY_KEY = "history"
"""The state store's record, per event, of this VM's history write: {"status", "attempt", "at", "error"}."""


class HistoryNote(TypedDict):
    """The state store's `history` record of an event."""

    status: HistoryStatus
    attempt: int
    at: str
    error: NotRequired[str]


class HistoryRead(TypedDict):
    """The group's history as /v1/fleet/history shows it (with the backend's name)."""

    group: str
    since: str
    events: list[EventHistory]
    unreadable_records: int
MAX_ATTEMPTS = 2
"""Creates per VM per event at most (the first, and one more after a failure or a restart mid-request)."""
RETRY_AFTER = 60.0
"""Seconds after a failed write before the one retry."""

Note = Callable[[str, HistoryNote, bool], None]
"""(event_id, value, write_through): record the write's progress under HISTORY_KEY in the state store."""


def finished(note: dict[str, Any] | None) -> bool:
    """Whether nothing more will ever be written for the event: recorded, or its last attempt failed."""
    if note is None:
        return False
    attempt = note.get("attempt")
    return note.get("status") in (RECORDED, EXISTED) or (note.get("status") == FAILED and isinstance(attempt, int)
                                                          and attempt >= MAX_ATTEMPTS)


def due(note: dict[str, Any] | None, now: datetime, sent: int | None) -> int | None:
    """The attempt to make now for an ended event (None: nothing to do), from its note in the state store and the
    attempt this run of maintd last queued (`sent`; None: none since it started)."""
    attempt = note.get("attempt") if note is not None else None
    status = note.get("status") if note is not None else None
    if sent is not None and (attempt != sent or status == SENDING):
        return None  # queued or under way
    if note is None:
        return 1
    if status in (RECORDED, EXISTED) or not isinstance(attempt, int) or attempt >= MAX_ATTEMPTS:
        return None
    if status == FAILED:
        at = instant_or_none(note.get("at"))
        waited = RETRY_AFTER if at is None else (now - at).total_seconds()
        return attempt + 1 if waited >= RETRY_AFTER else None
    return attempt + 1  # `sending` found after a restart: the request may or may not have landed


class FleetHistory:
    """Writes this VM's outcomes (the `history` lane) and reads the group's (API workers); thread-safe."""

    def __init__(self, store: Callable[[], Store], note: Note, clock: Clock,
                 count_error: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.note = note
        self.clock = clock
        self.log = logs.get("history")
        self._lanes = Lanes(1, "history", count_error)

    def write(self, group: str, outcome: VmOutcome, attempt: int) -> None:
        """Queue the write of `outcome` (attempt 1 or 2); returns at once."""
        eid = outcome.event_id
        self._lanes.submit(eid, functools.partial(self._write, group, outcome, attempt),
                           functools.partial(self._failed, eid, attempt))

    def _write(self, group: str, outcome: VmOutcome, attempt: int) -> None:
        eid = outcome.event_id
        self.note(eid, {"status": SENDING, "attempt": attempt, "at": iso_z(self.clock.now())}, True)
        try:
            store = self.store()
            if outcome.approved_by is None:
                name = approval_blob(eid)
                items, _ = store.list_folder(name)
                found = next((i for i in items if i.name == name), None)
                if found is not None:
                    outcome = with_approval(outcome, found.metadata, found.last_modified)
            etag = store.create(history_blob(group, outcome), to_metadata(outcome))
        except StoreError as exc:
            self._failed(eid, attempt, exc)
            return
        status: HistoryStatus = RECORDED if etag is not None else EXISTED
        self.note(eid, {"status": status, "attempt": attempt, "at": iso_z(self.clock.now())}, False)
        self.log.info("history.recorded", event_id=eid, group=group, attempt=attempt, already=etag is None,
                      out_seconds=outcome.out_seconds, prepared_before_start=outcome.prepared_before_start)

    def _failed(self, event_id: str, attempt: int, exc: Exception) -> None:
        """A failed write (a store error, or a bug: the lane's failed callback): noted, retried once, then given up."""
        last = attempt >= MAX_ATTEMPTS
        self.note(event_id, {"status": FAILED, "attempt": attempt, "at": iso_z(self.clock.now()),
                             "error": str(exc)[:300]}, False)
        self.log.warning("history.not_recorded" if last else "history.write_failed", event_id=event_id,
                         attempt=attempt, error=str(exc)[:300],
                         effect="this VM is missing from the event's fleet history" if last
                         else f"retried once in {RETRY_AFTER:.0f}s")

    def read(self, group: str, since: datetime, now: datetime) -> HistoryRead:
        """The group's events that ended since `since` (raises StoreError when the store cannot answer)."""
        store = self.store()
        records, problems = [], 0
        for day in days(since, now):
            items, _ = store.list_folder(day_folder(group, day))
            for item in items:
                parsed = parse_record(item)
                if parsed is None:
                    problems += 1
                else:
                    records.append(parsed)
        return {"group": group, "since": iso_z(since), "events": history_view(records, since),
                "unreadable_records": problems}

    def wait_idle(self, timeout: float) -> bool:
        return self._lanes.wait_idle(timeout)

    def stop(self) -> None:
        self._lanes.shutdown()
