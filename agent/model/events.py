"""Immutable Scheduled Events types and a tolerant parser for every API version's document.

Tolerance rules (documented in the README):
- unknown EventType / EventStatus values are kept as text;
- missing optional fields get defaults: ResourceType "VirtualMachine", Resources [], Description "",
  EventSource "Platform", DurationInSeconds -1 (unknown), NotBefore none;
- NotBefore is RFC 1123 on the wire (`Mon, 19 Sep 2016 18:29:47 GMT`), ISO 8601 is accepted too,
  and "" (once Started) or an unparsable value means "no deadline";
- DocumentIncarnation may be a number or a numeric string;
- an event without a usable EventId, EventType or EventStatus is skipped (reported, never raised);
- a document that is not an object with an `Events` list is malformed as a whole (`DocumentError`):
  the caller treats that poll as failed instead of reading it as "every event vanished".

Size rules (a hostile or broken IMDS must not become huge log lines, state writes or hook
environments): a document with more than MAX_EVENTS events is malformed as a whole; an event with
more than MAX_RESOURCES names, or an EventId/EventType/EventStatus longer than MAX_ID characters or
not printable, is skipped; Resources names longer than MAX_NAME or not printable are dropped; other
short fields that are too long or not printable get their defaults; Description keeps its first
MAX_DESCRIPTION characters (with a "[cut …]" marker) and loses NUL characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Literal, TypedDict

from agent.errors import DocumentError
from agent.model.timefmt import iso_z, parse_iso_utc
from agent.net.httpdates import parse_http_date

KNOWN_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
Status = Literal["Scheduled", "Started"]
"""The EventStatus values IMDS documents (an event's status is kept as IMDS sent it: any other is reported)."""
SCHEDULED: Final = "Scheduled"
STARTED: Final = "Started"
KNOWN_STATUSES: tuple[Status, ...] = (SCHEDULED, STARTED)
"""Every EventStatus IMDS documents; compare with these names, never with the literals."""
_LIVE_MIGRATION = re.compile(r"live[ -]?migration", re.IGNORECASE)
MAX_EVENTS = 10_000
"""Most events read from one document (ten times the largest benchmarked); more is a malformed document."""
MAX_RESOURCES = 1_000
"""Most names in one event's Resources (an availability set holds at most 200 VMs)."""
MAX_NAME = 256
"""Longest Resources name or VM name kept (Azure VM names are at most 64 characters)."""
MAX_ID = 128
"""Longest EventId, EventType, EventStatus, ResourceType, EventSource or NotBefore read (an EventId is 36)."""
MAX_DESCRIPTION = 4_096
"""Longest Description kept, its cut marker included."""


class EventJson(TypedDict):
    """An event in IMDS field names (`Event.to_json`): in the state file, /v1/events and the webhook's body."""

    EventId: str
    EventType: str
    ResourceType: str
    Resources: list[str]
    EventStatus: str
    NotBefore: str
    Description: str
    EventSource: str
    DurationInSeconds: int
    LiveMigration: bool


def maintenance_property(event_id: str) -> str:
    """The health report's Property for one event (the `health` handler's, which the fleet gate leaves out)."""
    return f"maintenance/{event_id}"


@dataclass(frozen=True)
class Event:
    """One scheduled event as IMDS described it in the latest document."""

    event_id: str
    event_type: str
    status: str
    resources: tuple[str, ...] = ()
    resource_type: str = "VirtualMachine"
    not_before: datetime | None = None
    not_before_raw: str = field(default="", compare=False)
    description: str = ""
    source: str = "Platform"
    duration_seconds: int = -1

    def names(self, vm_name: str) -> bool:
        """Whether Resources lists `vm_name`: exact but case-insensitive, never a substring (vm1 is not vm10)."""
        wanted = vm_name.casefold()
        return any(r.casefold() == wanted for r in self.resources)

    def rank(self, vm_name: str) -> int | None:
        """Position of `vm_name` in Resources (case-insensitive), or None when it is not listed."""
        wanted = vm_name.casefold()
        for i, r in enumerate(self.resources):
            if r.casefold() == wanted:
                return i
        return None

    @property
    def live_migration(self) -> bool:
        """A Freeze caused by a memory-preserving live migration (told only by its Description)."""
        return self.event_type == "Freeze" and bool(_LIVE_MIGRATION.search(self.description))

    @property
    def type_label(self) -> str:
        """EventType as a bounded metric label: the known types, or `Other`."""
        return self.event_type if self.event_type in KNOWN_TYPES else "Other"

    def to_json(self) -> EventJson:
        """The event in IMDS field names, NotBefore as ISO 8601 (or "")."""
        return {
            "EventId": self.event_id,
            "EventType": self.event_type,
            "ResourceType": self.resource_type,
            "Resources": list(self.resources),
            "EventStatus": self.status,
            "NotBefore": iso_z(self.not_before) if self.not_before else "",
            "Description": self.description,
            "EventSource": self.source,
            "DurationInSeconds": self.duration_seconds,
            "LiveMigration": self.live_migration,
        }


@dataclass(frozen=True)
class Skipped:
    """An event the parser could not use, and why; `event_id` is set when it could still be read."""

    index: int
    reason: str
    event_id: str | None = None


@dataclass(frozen=True)
class Document:
    """One Scheduled Events document, plus what the parser had to skip."""

    incarnation: int | None
    events: tuple[Event, ...]
    skipped: tuple[Skipped, ...] = field(default=())
    parsed: dict[tuple[Any, ...], Event] = field(default_factory=dict, compare=False, repr=False)
    """Each event by the field values it was parsed from, for the next document's parse to reuse."""


def parse_not_before(raw: Any) -> datetime | None:
    """RFC 1123 first, then ISO 8601; "" or anything unparsable is None (no deadline)."""
    if not isinstance(raw, str) or not raw.strip():
        return None
    text = raw.strip()
    parsed = parse_http_date(text)
    if parsed is None:
        try:
            parsed = parse_iso_utc(text)
        except (ValueError, OverflowError):
            return None
    return parsed.astimezone(UTC)


def _short(value: Any, limit: int = MAX_ID) -> bool:
    """Whether `value` is printable text of at most `limit` characters."""
    return isinstance(value, str) and len(value) <= limit and value.isprintable()


def _text(item: dict[str, Any], key: str, default: str = "") -> str:
    value = item.get(key, default)
    return value if _short(value) else default


def _required_text(item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    text = value.strip() if isinstance(value, str) else ""
    if not text:
        raise ValueError(f"{key} missing or not text")
    if not _short(text):
        raise ValueError(f"{key} longer than {MAX_ID} characters or not printable")
    return text


def _description(value: Any) -> str:
    """Description without NUL characters, at most MAX_DESCRIPTION characters (marked when cut)."""
    if not isinstance(value, str):
        return ""
    text = value.replace("\0", "")
    if len(text) <= MAX_DESCRIPTION:
        return text
    kept = MAX_DESCRIPTION - 48  # room for the marker, so a cut Description read again is not cut again
    return f"{text[:kept]} … [cut: {len(text) - kept} more characters]"


def _duration(value: Any) -> int:
    if isinstance(value, bool):
        return -1
    if isinstance(value, (int, float)) and value == value and abs(value) < 2**31:
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return -1
    return -1


def _incarnation(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


FIELDS = ("EventId", "EventType", "EventStatus", "Resources", "ResourceType", "NotBefore", "Description",
          "EventSource", "DurationInSeconds")
_ABSENT = object()


def _key(item: Any) -> tuple[Any, ...]:
    """An event's field values, as a key that is equal exactly when the event's JSON is (true == 1 in
    Python, but DurationInSeconds true is no duration: whether it is a bool is part of the key)."""
    if not isinstance(item, dict):
        raise ValueError("event is not an object")
    values = tuple(tuple(v) if isinstance(v, list) else v for v in (item.get(f, _ABSENT) for f in FIELDS))
    return values + (isinstance(item.get("DurationInSeconds"), bool),)


def parse_event(item: Any) -> Event:
    """One event from its JSON object; raises ValueError naming the field that makes it unusable."""
    return _parse_fields(_key(item))


def _parse_fields(key: tuple[Any, ...]) -> Event:
    item = {f: v for f, v in zip(FIELDS, key, strict=False) if v is not _ABSENT}  # zip stops before the bool marker
    resources = item.get("Resources", ())
    if not isinstance(resources, tuple):
        raise ValueError("Resources is not a list")
    if len(resources) > MAX_RESOURCES:
        raise ValueError(f"Resources lists {len(resources)} names, more than {MAX_RESOURCES}")
    raw_nb = item.get("NotBefore", "")
    raw_nb = raw_nb if _short(raw_nb) else ""
    return Event(
        event_id=_required_text(item, "EventId"),
        event_type=_required_text(item, "EventType"),
        status=_required_text(item, "EventStatus"),
        resources=tuple(r for r in resources if _short(r, MAX_NAME)),
        resource_type=_text(item, "ResourceType", "VirtualMachine"),
        not_before=parse_not_before(raw_nb),
        not_before_raw=raw_nb,
        description=_description(item.get("Description")),
        source=_text(item, "EventSource", "Platform") or "Platform",
        duration_seconds=_duration(item.get("DurationInSeconds", -1)),
    )


def parse_document(data: Any, previous: Document | None = None) -> Document:
    """A Document from decoded JSON; skips bad events, raises DocumentError if the whole is unusable.

    An event whose fields are all as they were in `previous` is that document's Event, not parsed
    again: at 1 Hz nearly every event comes back unchanged, so a 1000-event document in which one
    event changed costs little more than its JSON. Only the previous document's events are reused,
    so what is kept never outgrows one document.
    """
    if not isinstance(data, dict):
        raise DocumentError("document is not a JSON object")
    raw_events = data.get("Events")
    if not isinstance(raw_events, list):
        raise DocumentError("document has no Events list")
    if len(raw_events) > MAX_EVENTS:
        raise DocumentError(f"document lists {len(raw_events)} events, more than {MAX_EVENTS}")
    known = previous.parsed if previous is not None else {}
    events: list[Event] = []
    parsed: dict[tuple[Any, ...], Event] = {}
    skipped: list[Skipped] = []
    for i, item in enumerate(raw_events):
        try:
            key = _key(item)
            try:
                event = known.get(key) or _parse_fields(key)
                parsed[key] = event
            except TypeError:  # an unhashable value (an object where text belongs): nothing to reuse
                event = _parse_fields(key)
            events.append(event)
        except ValueError as exc:
            eid = item.get("EventId") if isinstance(item, dict) else None
            eid = eid.strip() if isinstance(eid, str) else ""
            skipped.append(Skipped(i, str(exc), eid if eid and _short(eid) else None))
    return Document(_incarnation(data.get("DocumentIncarnation")), tuple(events), tuple(skipped), parsed)
