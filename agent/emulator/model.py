"""The emulated Scheduled Events state: events, their life cycle, and each VM's document.

Faithful to the field notes (shared/research/imds.md): one availability set whose events every VM
sees (`broadcast`), an incarnation per VM bumped on every change of its view, uppercase GUIDs,
NotBefore in RFC 1123 and `""` once Started, fields gated by api-version, the cancel path
(Scheduled → gone), the hardware-failure path (created Started) and the 24 h reset.

This module shares nothing with the client side (`agent.events`, `agent.imds`): a mistake in one
is never mirrored by the other.
"""

from __future__ import annotations

import email.utils
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

API_VERSIONS = ("2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01")
"""Scheduled Events versions, oldest first; the fields each adds are gated in `render_event`."""
NEWEST_VERSIONS = ["2020-10-01", "2020-09-01", "2020-07-15"]
"""What IMDS lists as `newest-versions` in its 400 body (captured from the field)."""
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
DEFAULT_STARTED_DURATION = 10.0


class ModelClock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...


def rfc1123(t: datetime) -> str:
    """NotBefore as IMDS writes it: `Mon, 19 Sep 2016 18:29:47 GMT`."""
    return email.utils.format_datetime(t.astimezone(timezone.utc), usegmt=True)


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


def render_event(e: EmuEvent, api_version: str) -> dict[str, Any]:
    """One event as a VM asking with `api_version` sees it (later fields left out for older versions)."""
    resources = [f"_{r}" for r in e.resources] if api_version == "2017-03-01" else list(e.resources)
    out: dict[str, Any] = {
        "EventId": e.event_id,
        "EventStatus": e.status,
        "EventType": e.event_type,
        "ResourceType": e.resource_type,
        "Resources": resources,
        "NotBefore": rfc1123(e.not_before) if e.status == "Scheduled" and e.not_before else "",
    }
    if api_version >= "2019-04-01":
        out["Description"] = e.description
    if api_version >= "2019-08-01":
        out["EventSource"] = e.source
    if api_version >= "2020-07-01":
        out["DurationInSeconds"] = e.duration_seconds
    return out


class Model:
    """Thread-safe event state for a set of VMs."""

    def __init__(self, vms: list[str], clock: ModelClock, *, time_scale: float = 1.0,
                 started_duration: float | None = None, approvals_required: int | None = None,
                 broadcast: bool = True, unknown_event: str = "ok") -> None:
        self.vms = list(vms)
        self.clock = clock
        self.time_scale = time_scale
        self.started_duration = DEFAULT_STARTED_DURATION if started_duration is None else started_duration
        self.approvals_required = approvals_required
        self.broadcast = broadcast
        self.unknown_event = unknown_event
        self.events: dict[str, EmuEvent] = {}
        self.incarnation = {vm: 1 for vm in vms}
        self.generation = 0
        """Bumped by each reset, so an ETag never repeats across one."""
        self.approval_log: list[dict[str, Any]] = []
        self.changes: list[dict[str, Any]] = []
        self.lock = threading.RLock()

    def real(self, emulated_seconds: float) -> float:
        """Real seconds for a span of emulated time (time_scale > 1 runs faster)."""
        return emulated_seconds / self.time_scale

    # --- visibility and documents ------------------------------------------------------------

    def visible(self, e: EmuEvent, vm: str) -> bool:
        return self.broadcast or any(r.casefold() == vm.casefold() for r in e.resources)

    def _changed(self, e: EmuEvent, what: str) -> None:
        for vm in self.vms:
            if self.visible(e, vm):
                self.incarnation[vm] += 1
        self.changes.append({"change": what, "event_id": e.event_id, "status": e.status,
                             "at": self.clock.now().isoformat()})

    def document(self, vm: str, api_version: str = "2020-07-01") -> dict[str, Any]:
        with self.lock:
            self.tick()
            return {"DocumentIncarnation": self.incarnation[vm],
                    "Events": [render_event(e, api_version) for e in self.events.values() if self.visible(e, vm)]}

    # --- life cycle --------------------------------------------------------------------------

    def add_event(self, *, event_type: str = "Reboot", resources: list[str] | None = None, notice: float = 900.0,
                  description: str = "", event_source: str = "Platform", duration_seconds: int = -1,
                  status: str = "Scheduled", resource_type: str = "VirtualMachine",
                  event_id: str | None = None) -> str:
        """Create an event; `notice` is emulated seconds until NotBefore; status Started = hardware failure."""
        if status not in ("Scheduled", "Started"):
            raise ValueError(f"status must be Scheduled or Started, not {status!r}")
        names = list(resources) if resources else self.vms[:1]
        unknown = [r for r in names if r not in self.vms]
        if unknown:
            raise ValueError(f"resources {unknown} are not emulated VMs ({', '.join(self.vms)})")
        now = self.clock.now()
        with self.lock:
            eid = event_id or str(uuid.uuid4()).upper()
            if eid in self.events:
                raise ValueError(f"event {eid} exists")
            e = EmuEvent(eid, event_type, names, status,
                         now + timedelta(seconds=self.real(notice)) if status == "Scheduled" else None,
                         description, event_source, int(duration_seconds), resource_type,
                         started_at=now if status == "Started" else None)
            self.events[eid] = e
            self._changed(e, "created")
            return eid

    def _get(self, event_id: str) -> EmuEvent:
        e = self.events.get(event_id)
        if e is None:
            raise KeyError(f"no event {event_id}")
        return e

    def start_event(self, event_id: str) -> None:
        with self.lock:
            e = self._get(event_id)
            if e.status == "Started":
                return
            e.status, e.started_at = "Started", self.clock.now()
            self._changed(e, "started")

    def complete_event(self, event_id: str) -> None:
        with self.lock:
            e = self._get(event_id)
            del self.events[event_id]
            self._changed(e, "completed")

    def cancel_event(self, event_id: str) -> None:
        with self.lock:
            e = self._get(event_id)
            if e.status != "Scheduled":
                raise ValueError(f"event {event_id} is {e.status}; only a Scheduled event can be canceled")
            del self.events[event_id]
            self._changed(e, "canceled")

    def reset_incarnation(self) -> None:
        """The 24 h disable: every event dropped, DocumentIncarnation back to 1."""
        with self.lock:
            self.events.clear()
            self.incarnation = {vm: 1 for vm in self.vms}
            self.generation += 1
            self.changes.append({"change": "reset", "at": self.clock.now().isoformat()})

    def tick(self) -> None:
        """Start events whose NotBefore has come; remove Started events whose time is up."""
        now = self.clock.now()
        with self.lock:
            for e in list(self.events.values()):
                if e.status == "Scheduled" and e.not_before is not None and now >= e.not_before:
                    e.status, e.started_at = "Started", now
                    self._changed(e, "started")
                elif e.status == "Started" and e.started_at is not None:
                    stay = e.duration_seconds if e.duration_seconds > 0 else self.started_duration
                    if now >= e.started_at + timedelta(seconds=self.real(stay)):
                        del self.events[e.event_id]
                        self._changed(e, "completed")

    # --- approval ----------------------------------------------------------------------------

    def approve(self, vm: str, event_ids: list[str]) -> tuple[int, dict[str, Any]]:
        """A StartRequests POST from `vm`: (status, body) as IMDS would answer."""
        with self.lock:
            self.tick()
            unknown = [i for i in event_ids if i not in self.events or not self.visible(self.events[i], vm)]
            if unknown and self.unknown_event == "400":
                return 400, {"error": f"Bad request. Unknown EventId {unknown[0]}"}
            accepted = [i for i in event_ids if i not in unknown]
            for eid in accepted:
                e = self.events[eid]
                e.approvals.add(vm)
                needed = self.approvals_required or 1
                if e.status == "Scheduled" and len(e.approvals) >= needed:
                    e.status, e.started_at = "Started", self.clock.now()
                    self._changed(e, "approved")
            self.approval_log.append({"vm": vm, "event_ids": accepted, "unknown": unknown,
                                      "time": self.clock.now().timestamp(), "mono": self.clock.monotonic()})
            return 200, {}
