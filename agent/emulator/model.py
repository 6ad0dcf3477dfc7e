"""The emulated Scheduled Events state: events, their life cycle, and what each VM's document shows.

Pure: no I/O and no thread of its own. Time comes from an injected clock, and every span handed to
the model (notice, durations) is in *emulated* seconds, divided by `time_scale` to get clock seconds.

Faithful to the field notes (shared/research/imds.md §1, §3, §9): one availability set whose events
every VM sees (`broadcast`), a DocumentIncarnation per VM bumped on every change of its view,
uppercase GUIDs, NotBefore in RFC 1123 and `""` once Started, fields and event types gated by
api-version, the cancel path (Scheduled → gone), the hardware-failure path (created Started), the
VMSS Terminate batch rule and the 24 h reset.

Shares nothing with the client side (`agent.model.events`, `agent.imds.imds_client`,
`agent.model.tracker`): a mistake in one is never mirrored by the other.
"""

from __future__ import annotations

import email.utils
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, NotRequired, Protocol, TypedDict

API_VERSIONS = ("2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01")
"""Every Scheduled Events api-version, oldest first (none newer than 2020-07-01 is documented)."""
NEWEST_VERSIONS = ["2020-10-01", "2020-09-01", "2020-07-15"]
"""What IMDS lists as `newest-versions` in its 400 body (captured in the field)."""
FIELD_SINCE: tuple[tuple[Literal["Description", "EventSource", "DurationInSeconds"], str], ...] = (
    ("Description", "2019-04-01"), ("EventSource", "2019-08-01"), ("DurationInSeconds", "2020-07-01"))
TYPE_SINCE = {"Preempt": "2017-11-01", "Terminate": "2019-01-01"}
"""Older api-versions are not sent these event types at all."""
MIN_NOTICE = {"Freeze": 900.0, "Reboot": 900.0, "Redeploy": 600.0, "Preempt": 30.0, "Terminate": 300.0}
"""The documented minimum notice per EventType (seconds), the default `notice` of a new event."""
STATUSES = ("Scheduled", "Started")
DEFAULT_STARTED_DURATION = 10.0
UNKNOWN_EVENT_ANSWERS = ("ok", "400")

Listener = Callable[[str, dict[str, Any]], None]
"""Told of every state change: (stable event name, fields). Called under the model lock: must not block."""


class ImdsEvent(TypedDict):
    """One event of the document as IMDS sends it (an older api-version is not sent the later fields)."""

    EventId: str
    EventStatus: str
    EventType: str
    ResourceType: str
    Resources: list[str]
    NotBefore: str
    Description: NotRequired[str]
    EventSource: NotRequired[str]
    DurationInSeconds: NotRequired[int]


class ImdsDocument(TypedDict):
    """The Scheduled Events document one VM gets."""

    DocumentIncarnation: int
    Events: list[ImdsEvent]


class ModelClock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...


class UnknownEventError(ValueError):
    """A StartRequests POST naming an event this VM cannot see (with unknown_event="400")."""


def rfc1123(t: datetime) -> str:
    """NotBefore as IMDS writes it: `Mon, 19 Sep 2016 18:29:47 GMT`."""
    return email.utils.format_datetime(t.astimezone(UTC).replace(microsecond=0), usegmt=True)


@dataclass
class EmuEvent:
    event_id: str
    event_type: str
    resources: list[str]
    status: str
    not_before: datetime | None
    description: str = ""
    source: str = "Platform"
    duration_seconds: int = -1
    resource_type: str = "VirtualMachine"
    started_at: datetime | None = None
    approvals: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Approval:
    """One accepted StartRequests POST: who sent it, what it named, and which of those it could not see."""

    vm: str
    event_ids: list[str]
    unknown: list[str]
    time: float
    """Wall clock, seconds since the epoch."""
    monotonic: float


def render_event(e: EmuEvent, api_version: str) -> ImdsEvent | None:
    """The event as a VM asking with `api_version` sees it; None when that version is not sent its type."""
    if api_version < TYPE_SINCE.get(e.event_type, API_VERSIONS[0]):
        return None
    out: ImdsEvent = {
        "EventId": e.event_id,
        "EventStatus": e.status,
        "EventType": e.event_type,
        "ResourceType": e.resource_type,
        "Resources": [f"_{r}" for r in e.resources] if api_version == API_VERSIONS[0] else list(e.resources),
        "NotBefore": rfc1123(e.not_before) if e.status == "Scheduled" and e.not_before else "",
        "Description": e.description,
        "EventSource": e.source,
        "DurationInSeconds": e.duration_seconds,
    }
    for name, since in FIELD_SINCE:
        if api_version < since:
            del out[name]
    return out


class Model:
    """Thread-safe event state for a set of VMs."""

    def __init__(self, vms: list[str], clock: ModelClock, *, time_scale: float = 1.0,
                 started_duration: float | None = None, approvals_required: int | None = None,
                 broadcast: bool = True, unknown_event: str = "ok", listener: Listener | None = None) -> None:
        if not vms or len({v.casefold() for v in vms}) != len(vms) or not all(isinstance(v, str) and v for v in vms):
            raise ValueError(f"vms must be distinct non-empty names, got {vms!r}")
        if not time_scale > 0:
            raise ValueError(f"time_scale must be above 0, got {time_scale!r}")
        if started_duration is not None and started_duration < 0:
            raise ValueError(f"started_duration must be >= 0, got {started_duration!r}")
        if approvals_required is not None and approvals_required < 1:
            raise ValueError(f"approvals_required must be at least 1, got {approvals_required!r}")
        if unknown_event not in UNKNOWN_EVENT_ANSWERS:
            raise ValueError(f"unknown_event must be one of {UNKNOWN_EVENT_ANSWERS}, got {unknown_event!r}")
        self.vms = list(vms)
        self.clock = clock
        self.time_scale = float(time_scale)
        self.started_duration = DEFAULT_STARTED_DURATION if started_duration is None else float(started_duration)
        self.approvals_required = approvals_required or 1
        self.broadcast = broadcast
        self.unknown_event = unknown_event
        self.listener = listener
        self.lock = threading.RLock()
        self._events: dict[str, EmuEvent] = {}
        self._incarnation = {vm: 1 for vm in self.vms}
        self._approvals: list[Approval] = []

    def real(self, emulated_seconds: float) -> float:
        """Clock seconds for a span of emulated time (time_scale > 1 runs faster)."""
        return emulated_seconds / self.time_scale

    def _notify(self, name: str, **fields: Any) -> None:
        if self.listener is not None:
            self.listener(name, fields)

    def _vm(self, vm: str) -> str:
        if vm not in self._incarnation:
            raise ValueError(f"no emulated VM {vm!r} (VMs: {', '.join(self.vms)})")
        return vm

    # --- what a VM sees ----------------------------------------------------------------------

    def visible(self, e: EmuEvent, vm: str) -> bool:
        """Broadcast (an availability set): every VM sees every event; otherwise only those naming it."""
        return self.broadcast or vm in e.resources

    def document(self, vm: str, api_version: str = API_VERSIONS[-1]) -> ImdsDocument:
        """The Scheduled Events document `vm` gets now when asking with `api_version`."""
        with self.lock:
            self._vm(vm)
            self.tick()
            rendered = (render_event(e, api_version) for e in self._events.values() if self.visible(e, vm))
            return {"DocumentIncarnation": self._incarnation[vm], "Events": [r for r in rendered if r is not None]}

    def _changed(self, e: EmuEvent, name: str, **fields: Any) -> None:
        for vm in self.vms:
            if self.visible(e, vm):
                self._incarnation[vm] += 1
        self._notify(f"emulator.event_{name}", event_id=e.event_id, event_type=e.event_type,
                     resources=list(e.resources), status=e.status, **fields)

    # --- life cycle --------------------------------------------------------------------------

    def add_event(self, event_type: str = "Reboot", resources: list[str] | None = None, notice: float | None = None,
                  description: str = "", event_source: str = "Platform", duration_seconds: int = -1,
                  status: str = "Scheduled", resource_type: str = "VirtualMachine",
                  event_id: str | None = None) -> str:
        """Create an event; returns its EventId (an uppercase GUID unless given).

        `resources` defaults to the first VM and may name VMs that are not emulated; `notice` is
        emulated seconds until NotBefore (default: the type's documented minimum notice);
        `status="Started"` is the hardware-failure path (no Scheduled phase, NotBefore "").
        """
        if not isinstance(event_type, str) or not event_type:
            raise ValueError(f"event_type must be a non-empty string, got {event_type!r}")
        names = self.vms[:1] if resources is None else resources
        if not isinstance(names, list) or not names or not all(isinstance(r, str) and r for r in names):
            raise ValueError(f"resources must be a non-empty list of VM names, got {resources!r}")
        notice = MIN_NOTICE.get(event_type, 900.0) if notice is None else notice
        if isinstance(notice, bool) or not isinstance(notice, (int, float)) or notice < 0:
            raise ValueError(f"notice must be a number of seconds >= 0, got {notice!r}")
        if isinstance(duration_seconds, bool) or not isinstance(duration_seconds, int):
            raise ValueError(f"duration_seconds must be an integer (-1: unknown), got {duration_seconds!r}")
        if status not in STATUSES:
            raise ValueError(f"status must be Scheduled or Started (a hardware failure), got {status!r}")
        for name, value in (("description", description), ("event_source", event_source),
                            ("resource_type", resource_type)):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
        now = self.clock.now()
        with self.lock:
            eid = str(uuid.uuid4()).upper() if event_id is None else str(event_id)
            if not eid or eid in self._events:
                raise ValueError(f"event_id {eid!r} is empty or already exists")
            scheduled = status == "Scheduled"
            e = EmuEvent(eid, event_type, list(names), status,
                         now + timedelta(seconds=self.real(notice)) if scheduled else None,
                         description, event_source, duration_seconds, resource_type,
                         started_at=None if scheduled else now)
            self._events[eid] = e
            self._changed(e, "created", not_before=e.not_before.isoformat() if e.not_before else "")
            return eid

    def _get(self, event_id: str) -> EmuEvent:
        e = self._events.get(event_id)
        if e is None:
            raise KeyError(f"no event {event_id}")
        return e

    def _start(self, e: EmuEvent, why: str) -> None:
        e.status, e.started_at = "Started", self.clock.now()
        self._changed(e, "started", reason=why)

    def start_event(self, event_id: str) -> None:
        """Scheduled → Started now (no-op when already Started); KeyError if there is no such event."""
        with self.lock:
            e = self._get(event_id)
            if e.status == "Scheduled":
                self._start(e, "admin")

    def complete_event(self, event_id: str) -> None:
        """Remove the event: maintenance done (or, for a Scheduled one, gone without starting)."""
        with self.lock:
            e = self._events.pop(self._get(event_id).event_id)
            self._changed(e, "completed", reason="admin")

    def cancel_event(self, event_id: str) -> None:
        """The cancel path: a Scheduled event leaves the document without ever starting."""
        with self.lock:
            e = self._get(event_id)
            if e.status != "Scheduled":
                raise ValueError(f"event {event_id} is {e.status}; only a Scheduled event can be canceled")
            del self._events[event_id]
            self._changed(e, "canceled")

    def reset_incarnation(self) -> None:
        """The 24 h disable and re-enable: every event dropped, every DocumentIncarnation back to 1."""
        with self.lock:
            self._events.clear()
            self._incarnation = {vm: 1 for vm in self.vms}
            self._notify("emulator.reset")

    def _approved(self, e: EmuEvent) -> bool:
        """Enough approvals; a Terminate also waits for every Terminate in its batch (same NotBefore)."""
        if len(e.approvals) < self.approvals_required:
            return False
        if e.event_type != "Terminate":
            return True
        return all(len(o.approvals) >= self.approvals_required for o in self._events.values()
                   if o.event_type == "Terminate" and o.status == "Scheduled" and o.not_before == e.not_before)

    def tick(self) -> None:
        """Start approved events and those whose NotBefore has come; remove Started events whose time is up."""
        with self.lock:
            now = self.clock.now()
            for e in list(self._events.values()):
                if e.status == "Scheduled":
                    if self._approved(e):
                        self._start(e, "approved")
                    elif e.not_before is not None and now >= e.not_before:
                        self._start(e, "not_before")
                elif e.started_at is not None:
                    stay = e.duration_seconds if e.duration_seconds > 0 else self.started_duration
                    if now >= e.started_at + timedelta(seconds=self.real(stay)):
                        del self._events[e.event_id]
                        self._changed(e, "completed", reason="duration")

    # --- approval ----------------------------------------------------------------------------

    def approve(self, vm: str, event_ids: list[str]) -> Approval:
        """A StartRequests POST from `vm`, already checked to be well formed.

        Any VM that sees an event may approve it, as in Azure ("acknowledging an event allows the
        event to proceed for all Resources"). An id this VM cannot see is a no-op answered 200, or
        raises UnknownEventError (400) with unknown_event="400"; approving again is a 200 no-op.
        """
        with self.lock:
            self._vm(vm)
            self.tick()
            unknown = [i for i in event_ids if i not in self._events or not self.visible(self._events[i], vm)]
            if unknown and self.unknown_event == "400":
                raise UnknownEventError(f"unknown EventId {unknown[0]}")
            for eid in event_ids:
                if eid not in unknown:
                    self._events[eid].approvals.add(vm)
            approval = Approval(vm, list(event_ids), unknown, self.clock.now().timestamp(), self.clock.monotonic())
            self._approvals.append(approval)
            self._notify("emulator.approval", vm=vm, event_ids=list(event_ids), unknown=unknown)
            self.tick()
            return approval

    def approvals(self, vm: str | None = None) -> list[Approval]:
        """Accepted StartRequests POSTs, oldest first (from `vm` only, if given)."""
        with self.lock:
            return [a for a in self._approvals if vm is None or a.vm == vm]


@dataclass
class RecordedRequest:
    """A request one VM's IMDS received; `status` is None while unanswered or when it was dropped."""

    vm: str
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: str
    status: int | None
    time: float
    """Wall clock, seconds since the epoch."""
    monotonic: float
