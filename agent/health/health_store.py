"""The health store, on the Service Fabric health model.

A report is (SourceId, Property, HealthState, Description, TimeToLive, RemoveWhenExpired,
SequenceNumber); the store keeps one per (SourceId, Property). External watchdogs POST reports with
their own SequenceNumber (`report`, stale ones are refused); maintd's own parts call `set`, which
numbers them itself. A report past its TimeToLive is dropped if RemoveWhenExpired, otherwise it
counts as Error. The aggregated state is the worst report. Expiry is evaluated lazily against the
clock whenever the store is read. Pure: no I/O; safe to share between threads.
"""

from __future__ import annotations

import enum
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from agent.clock import Clock
from agent.errors import ReservedSource, StaleReport, TooManyReports
from agent.health.health_json import EventHealthEvaluation, HealthEventJson, HealthView
from agent.model.config_schema import parse_duration_text
from agent.model.timefmt import iso_z_or_none, parse_iso_utc

RESERVED_PREFIX = "System."
MAX_DESCRIPTION = 4096
_TRUNCATED = " [Truncated]"

SourceFilter = Callable[[str], bool]


class HealthState(enum.IntEnum):
    """Ok < Warning < Error, so `max()` is the worst."""

    OK = 0
    WARNING = 1
    ERROR = 2

    @property
    def label(self) -> str:
        """The JSON spelling: Ok, Warning or Error."""
        return self.name.title()

    @classmethod
    def parse(cls, value: str) -> HealthState:
        """The state named by `value`, case-insensitively (Ok, Warning, Error)."""
        try:
            return cls[value.strip().upper()]
        except (KeyError, AttributeError):
            raise ValueError(f"{value!r} is not a health state; use Ok, Warning or Error") from None


@dataclass(frozen=True)
class HealthReport:
    """One health report as sent; `ttl` in seconds (None: never expires)."""

    source_id: str
    property: str
    state: HealthState
    description: str = ""
    ttl: float | None = None
    remove_when_expired: bool = False
    sequence_number: int | None = None
    sent_at: datetime | None = None


@dataclass(frozen=True)
class HealthEvent:
    """A stored report as read at one instant: expiry computed, transition times attached."""

    report: HealthReport
    sequence_number: int
    received_at: datetime
    is_expired: bool
    last_ok_transition_at: datetime | None
    last_warning_transition_at: datetime | None
    last_error_transition_at: datetime | None

    @property
    def state(self) -> HealthState:
        """The state the event counts as: Error once expired, else the reported one."""
        return HealthState.ERROR if self.is_expired else self.report.state

    def to_json(self) -> HealthEventJson:
        """The Service Fabric HealthEvent fields (SequenceNumber as text, like SF's int64)."""
        r = self.report
        return {
            "SourceId": r.source_id,
            "Property": r.property,
            "HealthState": r.state.label,
            "Description": r.description,
            "SequenceNumber": str(self.sequence_number),
            "TimeToLiveInMilliSeconds": None if r.ttl is None else round(r.ttl * 1000),
            "RemoveWhenExpired": r.remove_when_expired,
            "SentAt": iso_z_or_none(r.sent_at or self.received_at),
            "ReceivedAt": iso_z_or_none(self.received_at),
            "IsExpired": self.is_expired,
            "LastOkTransitionAt": iso_z_or_none(self.last_ok_transition_at),
            "LastWarningTransitionAt": iso_z_or_none(self.last_warning_transition_at),
            "LastErrorTransitionAt": iso_z_or_none(self.last_error_transition_at),
        }



# --- parsing an external report ------------------------------------------------------------

def _text_field(body: dict[str, Any], key: str, required: bool) -> str:
    value = body.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise ValueError(f"{key}: required text, got {value!r}" if required else f"{key}: must be text, got {value!r}")
    return value


_DECIMAL = re.compile(r"[0-9]{1,19}")
"""Decimal text of a whole number in int64 range (str.isdigit also accepts '²' and 5000 digits)."""


def _decimal(value: Any) -> int | None:
    """The number that text of plain ASCII digits spells, or None for anything else."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        return int(value)
    return None


def _ttl_field(value: Any) -> float | None:
    key = "TimeToLiveInMilliSeconds"
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected milliseconds or an ISO 8601 duration such as PT30S, got {value!r}")
    if (number := _decimal(value)) is not None:
        value = number
    if isinstance(value, (int, float)):
        seconds = value / 1000 if abs(value) < 1e300 else float("inf")
    elif isinstance(value, str) and value.strip().upper().startswith("P"):
        try:
            seconds = parse_duration_text(value.strip().upper())
        except ValueError:
            raise ValueError(f"{key}: {value!r} is not an ISO 8601 duration such as PT30S") from None
    else:
        raise ValueError(f"{key}: expected milliseconds or an ISO 8601 duration such as PT30S, got {value!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{key}: must be positive and finite (leave it out for a report that never expires), "
                         f"got {value!r}")
    return float(seconds)


def _sequence_field(value: Any) -> int | None:
    if value is None:
        return None
    if (number := _decimal(value)) is not None:
        return number
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    raise ValueError(f"SequenceNumber: expected a whole number >= 0 (or its decimal text), got {value!r}")


def _sent_at_field(value: Any) -> datetime | None:
    if value is None:
        return None
    try:
        sent = parse_iso_utc(value) if isinstance(value, str) else None
    except ValueError:
        sent = None
    if sent is None:
        raise ValueError(f"SentAt: expected an ISO 8601 time such as 2026-01-01T00:00:00Z, got {value!r}")
    return sent


def parse_report(body: Any) -> HealthReport:
    """A report from the Service Fabric-shaped JSON a watchdog POSTs; ValueError names the bad field."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with SourceId, Property, HealthState and SequenceNumber")
    state_text = body.get("HealthState")
    if not isinstance(state_text, str):
        raise ValueError(f"HealthState: required text (Ok, Warning or Error), got {state_text!r}")
    try:
        state = HealthState.parse(state_text)
    except ValueError as exc:
        raise ValueError(f"HealthState: {exc}") from None
    remove = body.get("RemoveWhenExpired", False)
    if not isinstance(remove, bool):
        raise ValueError(f"RemoveWhenExpired: expected true or false, got {remove!r}")
    description = _text_field(body, "Description", required=False)
    if len(description) > MAX_DESCRIPTION:
        description = description[: MAX_DESCRIPTION - len(_TRUNCATED)] + _TRUNCATED
    return HealthReport(
        source_id=_text_field(body, "SourceId", required=True),
        property=_text_field(body, "Property", required=True),
        state=state,
        description=description,
        ttl=_ttl_field(body.get("TimeToLiveInMilliSeconds")),
        remove_when_expired=remove,
        sequence_number=_sequence_field(body.get("SequenceNumber")),
        sent_at=_sent_at_field(body.get("SentAt")),
    )


# --- the store -----------------------------------------------------------------------------

@dataclass
class _Entry:
    report: HealthReport
    sequence_number: int
    received_at: datetime
    expires_at: float | None  # monotonic
    transitions: dict[HealthState, datetime]


def _transitions(previous: _Entry | None, state: HealthState, now: datetime) -> dict[HealthState, datetime]:
    """SF semantics: entering a state stamps it; leaving one stamps when it was last in it."""
    if previous is None:
        return {state: now}
    if previous.report.state == state:
        return previous.transitions
    return {**previous.transitions, previous.report.state: now, state: now}


class HealthStore:
    """Reports keyed by (SourceId, Property); every method is thread-safe."""

    def __init__(self, clock: Clock, max_reports: int = 1000) -> None:
        self.clock = clock
        self.max_reports = max_reports
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._sequence = 0
        self._lock = threading.Lock()
        self._listeners: tuple[Callable[[], None], ...] = ()

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener` (outside the lock; it must not block) after a report is stored, removed or pruned."""
        self._listeners += (listener,)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def next_expiry_in(self) -> float | None:
        """Seconds until a report's TimeToLive runs out (a change nobody announces); None: none will."""
        with self._lock:
            mono = self.clock.monotonic()
            return min((e.expires_at - mono for e in self._entries.values()
                        if e.expires_at is not None and e.expires_at > mono),
                       default=None)

    def report(self, r: HealthReport) -> None:
        """Store an external report; raises StaleReport, ReservedSource, TooManyReports or ValueError."""
        if r.source_id.lower().startswith(RESERVED_PREFIX.lower()):
            raise ReservedSource(f"SourceId: {r.source_id!r} is reserved (SourceIds starting with "
                                 f"{RESERVED_PREFIX!r} belong to the system); pick another SourceId")
        if r.sequence_number is None:
            raise ValueError("SequenceNumber: required for an external report; send an increasing number "
                             "(for example the current time in milliseconds)")
        key = (r.source_id, r.property)
        with self._lock:
            self._prune_locked()
            previous = self._entries.get(key)
            if previous is not None and r.sequence_number <= previous.sequence_number:
                raise StaleReport(f"SequenceNumber: {r.sequence_number} is stale; the report stored for "
                                  f"SourceId={r.source_id!r}, Property={r.property!r} has {previous.sequence_number}; "
                                  "send a greater one")
            if previous is None and len(self._entries) >= self.max_reports:
                raise TooManyReports(f"the store already holds {self.max_reports} reports; remove some or reuse "
                                     "a (SourceId, Property)")
            self._store_locked(key, r, r.sequence_number, previous)
        self._changed()

    def set(self, source_id: str, property: str, state: HealthState, description: str = "",
            ttl: float | None = None, remove_when_expired: bool = False) -> None:
        """Store one of maintd's own reports, numbered by the store; an unchanged report is left alone."""
        key = (source_id, property)
        with self._lock:
            previous = self._entries.get(key)
            if previous is not None and ttl is None:
                p = previous.report
                if (p.state, p.description, p.ttl, p.remove_when_expired) == \
                        (state, description, None, remove_when_expired):
                    return
            self._sequence = max(self._sequence, previous.sequence_number if previous else 0) + 1
            r = HealthReport(source_id, property, state, description, ttl, remove_when_expired, self._sequence)
            self._store_locked(key, r, self._sequence, previous)
        self._changed()

    def _store_locked(self, key: tuple[str, str], r: HealthReport, sequence: int, previous: _Entry | None) -> None:
        now = self.clock.now()
        expires = None if r.ttl is None else self.clock.monotonic() + r.ttl
        self._entries[key] = _Entry(r, sequence, now, expires, _transitions(previous, r.state, now))

    def remove(self, source_id: str, property: str) -> None:
        """Forget the report for (source_id, property), if any."""
        with self._lock:
            removed = self._entries.pop((source_id, property), None) is not None
        if removed:
            self._changed()

    def report_config_problem(self, key: str, problem: str | None) -> None:
        """A file named by config `key` is unusable (`config/<key>` Error), or usable again (None)."""
        if problem is None:
            self.remove("config", key)
        else:
            self.set("config", key, HealthState.ERROR, problem)

    def prune(self) -> None:
        """Drop the expired reports that asked to be removed when expired."""
        with self._lock:
            pruned = self._prune_locked()
        if pruned:
            self._changed()

    def _prune_locked(self) -> bool:
        """Drop the expired reports that asked for it; whether there were any."""
        mono = self.clock.monotonic()
        gone = [k for k, e in self._entries.items()
                if e.report.remove_when_expired and e.expires_at is not None and mono >= e.expires_at]
        for key in gone:
            del self._entries[key]
        return bool(gone)

    def snapshot(self) -> list[HealthEvent]:
        """Every current report, expiry evaluated now, sorted by (SourceId, Property)."""
        with self._lock:
            self._prune_locked()  # the TTL wake-up of `next_expiry_in` makes a watcher look: no announcement
            mono = self.clock.monotonic()
            return [
                HealthEvent(
                    report=e.report,
                    sequence_number=e.sequence_number,
                    received_at=e.received_at,
                    is_expired=e.expires_at is not None and mono >= e.expires_at,
                    last_ok_transition_at=e.transitions.get(HealthState.OK),
                    last_warning_transition_at=e.transitions.get(HealthState.WARNING),
                    last_error_transition_at=e.transitions.get(HealthState.ERROR),
                )
                for _, e in sorted(self._entries.items())
            ]

    def _evaluated(self, consider_warning_as_error: bool, sources: SourceFilter | None,
                   events: list[HealthEvent]) -> list[tuple[HealthState, HealthEvent]]:
        out = []
        for ev in events:
            if sources is not None and not sources(ev.report.source_id):
                continue
            state = ev.state
            if consider_warning_as_error and state == HealthState.WARNING:
                state = HealthState.ERROR
            out.append((state, ev))
        return out

    def aggregate(self, consider_warning_as_error: bool = False, sources: SourceFilter | None = None) -> HealthState:
        """The worst state among the reports whose SourceId `sources` admits (all by default); Ok if none."""
        evaluated = self._evaluated(consider_warning_as_error, sources, self.snapshot())
        return max((state for state, _ in evaluated), default=HealthState.OK)

    def unhealthy(self, consider_warning_as_error: bool = False,
                  sources: SourceFilter | None = None) -> list[EventHealthEvaluation]:
        """SF EventHealthEvaluations for the events that make the aggregated state what it is."""
        return self._unhealthy(consider_warning_as_error, sources, self.snapshot())

    def _unhealthy(self, consider_warning_as_error: bool, sources: SourceFilter | None,
                   events: list[HealthEvent]) -> list[EventHealthEvaluation]:
        evaluated = self._evaluated(consider_warning_as_error, sources, events)
        worst = max((state for state, _ in evaluated), default=HealthState.OK)
        if worst == HealthState.OK:
            return []
        return [_evaluation(state, ev, consider_warning_as_error) for state, ev in evaluated if state == worst]

    def to_json(self, consider_warning_as_error: bool = False) -> HealthView:
        """The /v1/health body: AggregatedHealthState, UnhealthyEvaluations and every HealthEvent."""
        events = self.snapshot()
        evaluated = self._evaluated(consider_warning_as_error, None, events)
        worst = max((state for state, _ in evaluated), default=HealthState.OK)
        return {
            "AggregatedHealthState": worst.label,
            "UnhealthyEvaluations": self._unhealthy(consider_warning_as_error, None, events),
            "HealthEvents": [ev.to_json() for ev in events],
        }


def _evaluation(state: HealthState, ev: HealthEvent, consider_warning_as_error: bool) -> EventHealthEvaluation:
    """One SF EventHealthEvaluation, its Description readable on its own (the probe shows it)."""
    r = ev.report
    label = r.state.label
    if ev.is_expired:
        assert r.ttl is not None
        expired_at = ev.received_at + timedelta(seconds=r.ttl)
        label += f" event expired at {iso_z_or_none(expired_at)} (no new report within its TimeToLive; counts as Error)"
    elif state != r.state:
        label += " event (counted as Error: ConsiderWarningAsError)"
    else:
        label += " event"
    text = f"{label}: SourceId='{r.source_id}', Property='{r.property}'"
    return {
        "Kind": "Event",
        "Description": f"{text}: {r.description}" if r.description else text,
        "AggregatedHealthState": state.label,
        "ConsiderWarningAsError": consider_warning_as_error,
        "UnhealthyEvent": ev.to_json(),
    }
