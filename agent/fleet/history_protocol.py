"""Fleet history in the blob store, pure: one VM's outcome for one event, its blob, parsing it back, and the
summary of an event across the VMs that recorded it.

Layout: `history/{group}/{yyyy-mm-dd}/{event-id}/{vm}`, one blob per VM per event, created once
(If-None-Match: *) when the event has ended for that VM. The day is the event's NotBefore (the same
on every VM, so an event's records share one folder), or the day this VM first saw the event when
it had none. The record is blob metadata over an empty body, so one listing of a day's folder with
metadata returns every record of that day: reading a week is 8 listings, whatever the number of VMs
(250 records a page). Parsing is total: a blob of any shape is a record or a counted problem.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta
from typing import Any, TypedDict

from agent.coordination.store.store_protocol import APPROVED, Item
from agent.model.timefmt import iso_z, iso_z_or_none, optional_aware, parse_day

ROOT = "history/"
VERSION = "1"
NO_GROUP = "_"
"""The group of a VM with no scale set and no budget group."""
MAX_DAYS = 31
"""Days one history request reads at most (one listing each)."""
MAX_HANDLERS_TEXT = 2000
"""Characters of the handlers' outcomes kept in a record (blob metadata holds 8 KiB in all)."""
_SAFE = re.compile(r"[^a-z0-9._-]+")
_FIELDS = ("maintd", "kind", "event", "type", "vm", "not_before", "out_at", "back_at", "ready_at", "started_at",
           "prepared", "approved_by", "approved_at", "chosen", "handlers", "ended_at")


@dataclass(frozen=True)
class VmOutcome:
    """What one VM recorded about one event, once, when the event ended for it (immutable: the loop builds it,
    the history lane writes it)."""

    event_id: str
    event_type: str
    vm: str
    not_before: datetime | None
    out_at: datetime | None
    """When it left rotation for the event (its `event:<id>` drain began); None: never drained for it."""
    back_at: datetime | None
    """When it came back (that drain was lifted)."""
    ready_at: datetime | None
    """When its last scheduled-phase handler finished and it was ready; None: it never was."""
    started_at: datetime | None
    """When it saw the event Started (None: it did not see it, e.g. it was already rebooting)."""
    approved_by: str | None
    approved_at: datetime | None
    handlers: tuple[tuple[str, str, str], ...]
    """(handler, phase, outcome) of each run."""
    chosen: str | None
    """"chosen" or "forced" by the disruption budget; None without one."""
    ended_at: datetime
    day: date

    @property
    def start(self) -> datetime | None:
        """When maintenance began, as well as this VM knows: seen Started, else approved, else NotBefore."""
        return self.started_at or self.approved_at or self.not_before

    @property
    def prepared_before_start(self) -> bool | None:
        """Whether its preparation finished before the event started (None: no start is known)."""
        start = self.start
        if start is None:
            return None
        return self.ready_at is not None and self.ready_at <= start

    @property
    def out_seconds(self) -> float | None:
        """Time out of rotation for the event (until the end when it never came back)."""
        if self.out_at is None:
            return None
        return max(0.0, ((self.back_at or self.ended_at) - self.out_at).total_seconds())


def _segment(text: str) -> str:
    return _SAFE.sub("-", text.lower()).strip("-") or NO_GROUP


def group_name(budget_group: str | None, scale_set: str | None) -> str:
    """The history's group: the budget's, else the scale set's name, else `_`; safe as one path segment."""
    return _segment(budget_group or scale_set or NO_GROUP)


def day_folder(group: str, day: date) -> str:
    return f"{ROOT}{group}/{day.isoformat()}/"


def history_blob(group: str, outcome: VmOutcome) -> str:
    """Where a VM's outcome for an event lives: `history/{group}/{yyyy-mm-dd}/{event-id}/{vm}`."""
    return f"{day_folder(group, outcome.day)}{outcome.event_id.lower()}/{_segment(outcome.vm)}"


def days(since: datetime, now: datetime) -> list[date]:
    """The day folders a listing from `since` to `now` reads (at most MAX_DAYS, the latest)."""
    first, last = since.date(), now.date()
    count = min(MAX_DAYS, max(1, (last - first).days + 1))
    return [last - timedelta(days=n) for n in range(count)][::-1]


def _ascii(text: str) -> str:
    return text.encode("ascii", "replace").decode().replace("\n", " ")


def _when(t: datetime | None) -> str:
    return iso_z(t) if t is not None else ""


def to_metadata(outcome: VmOutcome) -> dict[str, str]:
    """The record as blob metadata (ASCII strings; "" for none, which the store may leave out)."""
    handlers = ";".join(f"{h}:{p}={o}" for h, p, o in outcome.handlers)[:MAX_HANDLERS_TEXT]
    prepared = outcome.prepared_before_start
    return {"maintd": VERSION, "kind": "history", "event": _ascii(outcome.event_id.lower()),
            "type": _ascii(outcome.event_type), "vm": _ascii(outcome.vm), "not_before": _when(outcome.not_before),
            "out_at": _when(outcome.out_at), "back_at": _when(outcome.back_at), "ready_at": _when(outcome.ready_at),
            "started_at": _when(outcome.started_at),
            "prepared": "" if prepared is None else "yes" if prepared else "no",
            "approved_by": _ascii(outcome.approved_by or ""), "approved_at": _when(outcome.approved_at),
            "chosen": outcome.chosen or "", "handlers": _ascii(handlers), "ended_at": _when(outcome.ended_at)}


def _handlers(text: str) -> tuple[tuple[str, str, str], ...]:
    out = []
    for part in filter(None, text.split(";")):
        run, _, outcome = part.rpartition("=")
        handler, _, phase = run.rpartition(":")
        if not (handler and phase and outcome):
            raise ValueError(f"a handler's outcome that is not handler:phase=outcome: {part[:60]!r}")
        out.append((handler, phase, outcome))
    return tuple(out)


def parse_record(item: Item) -> VmOutcome | None:
    """A listed history blob as a record; None for anything the protocol did not write (never an exception)."""
    try:
        given = {str(k).lower(): v for k, v in dict(item.metadata).items()}
        meta = {f: given.get(f) or "" for f in _FIELDS}  # an empty value may come back as None, or not at all
        if any(not isinstance(v, str) for v in meta.values()) or meta["maintd"] != VERSION \
                or meta["kind"] != "history" or not meta["event"] or not meta["vm"]:
            return None
        folder = item.name.split("/")
        ended = optional_aware(meta["ended_at"])
        if ended is None or meta["chosen"] not in ("", "chosen", "forced") or len(folder) != 5:
            return None
        return VmOutcome(event_id=meta["event"], event_type=meta["type"], vm=meta["vm"],
                         not_before=optional_aware(meta["not_before"]), out_at=optional_aware(meta["out_at"]),
                         back_at=optional_aware(meta["back_at"]), ready_at=optional_aware(meta["ready_at"]),
                         started_at=optional_aware(meta["started_at"]), approved_by=meta["approved_by"] or None,
                         approved_at=optional_aware(meta["approved_at"]), handlers=_handlers(meta["handlers"]),
                         chosen=meta["chosen"] or None, ended_at=ended, day=parse_day(folder[2]))
    except (ValueError, TypeError, AttributeError, KeyError, IndexError):
        return None


def with_approval(outcome: VmOutcome, metadata: Mapping[Any, Any] | None, last_modified: datetime | None) -> VmOutcome:
    """The outcome with who approved and when from the event's approval record in the store, when this VM did not
    approve itself (an `approved` record: its `by`, and its Last-Modified as the time)."""
    if outcome.approved_by is not None or not metadata or metadata.get("state") != APPROVED:
        return outcome
    by = metadata.get("by")
    return replace(outcome, approved_by=by if isinstance(by, str) and by else None,
                   approved_at=last_modified if isinstance(last_modified, datetime) and last_modified.tzinfo else None)


# --- summaries -----------------------------------------------------------------------------------

def most_out_at_once(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    """The most intervals overlapping at any instant (one ending as another begins is not an overlap)."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


class EventSummary(TypedDict):
    """One event across its VMs, in /v1/fleet/history."""

    vms: int
    most_out_at_once: int
    longest_out_seconds: float | None
    longest_out_vm: str | None
    not_prepared_before_start: list[str]
    forced: list[str]


class HandlerRun(TypedDict):
    """One handler's run in one phase, as a VM's record lists it."""

    handler: str
    phase: str
    outcome: str


class VmRecordView(TypedDict):
    """One VM's outcome for an event, in /v1/fleet/history."""

    vm: str
    out_at: str | None
    back_at: str | None
    out_seconds: float | None
    ready_at: str | None
    started_at: str | None
    prepared_before_start: bool | None
    approved_by: str | None
    approved_at: str | None
    chosen_or_forced: str | None
    ended_at: str
    handlers: list[HandlerRun]


class EventHistory(TypedDict):
    """One event that ended, in /v1/fleet/history: its summary and its VMs."""

    event_id: str
    event_type: str
    not_before: str | None
    ended_at: str
    approved_by: str | None
    approved_at: str | None
    summary: EventSummary
    vms: list[VmRecordView]


def summary(records: Sequence[VmOutcome]) -> EventSummary:
    """One event across its VMs: how many, the most out of rotation at once, the longest out, who was not prepared
    before the start."""
    outs = [(r.out_at, r.back_at or r.ended_at) for r in records if r.out_at is not None]
    longest = max((r for r in records if r.out_seconds is not None), key=lambda r: r.out_seconds or 0.0, default=None)
    return {"vms": len(records), "most_out_at_once": most_out_at_once(outs),
            "longest_out_seconds": None if longest is None else round(longest.out_seconds or 0.0, 1),
            "longest_out_vm": None if longest is None else longest.vm,
            "not_prepared_before_start": sorted(r.vm for r in records if r.prepared_before_start is False),
            "forced": sorted(r.vm for r in records if r.chosen == "forced")}


def record_view(r: VmOutcome) -> VmRecordView:
    out = r.out_seconds
    return {"vm": r.vm, "out_at": iso_z_or_none(r.out_at), "back_at": iso_z_or_none(r.back_at),
            "out_seconds": None if out is None else round(out, 1), "ready_at": iso_z_or_none(r.ready_at),
            "started_at": iso_z_or_none(r.started_at), "prepared_before_start": r.prepared_before_start,
            "approved_by": r.approved_by, "approved_at": iso_z_or_none(r.approved_at),
            "chosen_or_forced": r.chosen, "ended_at": iso_z(r.ended_at),
            "handlers": [{"handler": h, "phase": p, "outcome": o} for h, p, o in r.handlers]}


def history_view(records: Iterable[VmOutcome], since: datetime) -> list[EventHistory]:
    """The group's events that ended since `since`, oldest first: each with its summary and its VMs (one record
    per VM: a VM listed twice, from two day folders, counts once)."""
    by_event: dict[str, dict[str, VmOutcome]] = {}
    for r in records:
        by_event.setdefault(r.event_id, {}).setdefault(r.vm.lower(), r)
    events: list[EventHistory] = []
    for event_id, vms in by_event.items():
        rs = sorted(vms.values(), key=lambda r: r.vm)
        ended = max(r.ended_at for r in rs)
        if ended < since:
            continue
        approved = next((r for r in rs if r.approved_by), None)
        events.append({"event_id": event_id, "event_type": rs[0].event_type,
                       "not_before": iso_z_or_none(rs[0].not_before), "ended_at": iso_z(ended),
                       "approved_by": approved.approved_by if approved else None,
                       "approved_at": iso_z_or_none(approved.approved_at) if approved else None,
                       "summary": summary(rs), "vms": [record_view(r) for r in rs]})
    return sorted(events, key=lambda e: (e["ended_at"], e["event_id"]))
